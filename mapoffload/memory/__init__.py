"""Host memory: the bottom layer, imported by the page cache and by the offload parts, importing neither.

- ``cgroup``: the one walk of this process's memory cgroups (cap, usage, file cache per level).
- ``budget``: host memory available, the host-copy gate and its reserve, the page-cache budget.
- ``regions``: the residency index (``MappedRegions``), a tensor's bytes, ``mincore``, copy-on-write reports.
- ``ranks``: many ranks on one host (``local_world``, the staging rings' share).

Their contract names (``shared/DESIGN.md``) are importable from ``mapoffload`` itself.
"""
