"""The page cache: what the layers' mapped bytes may fill and how they are read in and let go.

Imports the memory layer, never the offload parts. Process-wide: the ``coordinator`` (one budget and
one plan for every stack of the process) and the ``peers`` registry (processes under one cap), the
``kernel`` probe, the ``uncached_read`` reader (``O_DIRECT``). Per stack: a ``member`` (what the
coordinator plans with: sizes, residency, window bytes, its share; ``apply(plan)``; and how it reads:
through the mapping or uncached, over the ``read_source`` interface) and its ``layer_pages`` (spans,
files, page reads and let-gos). Pure: the
``residency`` planner. Primitives: ``pages`` (read in, let go, edges; the page worker),
``file_places`` (the one address -> (file, offset) lookup), ``mapped_file`` (files held open by inode).
"""
