"""The layerwise offload manager's private parts.

``mapoffload.offload.LayerwiseOffloadManager`` sequences layers and hooks;
what it sequences lives here:

- ``plan``, ``stores``: which host store each managed weight gets (mapped,
  consolidated pinned/pageable, strided) and the stores themselves.
- ``placeholder``: what a layer's parameter slots hold while it is not loaded.
- ``loads``: the two ways a layer is made ready to compute - in place from
  its host stores (CPU), or copied into device buffers (``device_pool``).
- ``residency``, ``pages``, ``mapped_file``, ``rest``: the page cache - the
  plan of which layers stay cached, reading pages in and letting them go,
  the mapped files held open, and the mapped weights outside the layers.
"""
