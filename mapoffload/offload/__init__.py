"""Layerwise offload: the top layer, over the page cache and host memory.

``LayerwiseOffloadManager`` (``manager``) is a facade over these parts:

- ``options``: every knob validated once; ``plan``, ``stores``: which host store each weight gets and
  the stores themselves; ``placeholder``: what a released slot holds; ``grads``: autograd through
  managed layers.
- ``loads``, ``device_read_around``, ``device_pool``: how a layer is made ready (in place, device
  copies, read around the page cache); ``buffers``: what they hold on the host.
- ``layer_pages``: the stack's spans, files, page reads and let-gos; ``rest``: the mapped weights
  outside the layers; ``stream_reads``: how streamed layers are read (the ``auto`` policy).
- ``turn``: the layer turn and the hooks; ``host_edits``: the host weights read and replaced.

``mapoffload.offload`` is also the Hugging Face entry point's name in ``mapoffload``'s namespace
(a lazy attribute there); this package stays importable as ``mapoffload.offload``.
"""

from .manager import HOST_STORES, STREAM_READS, LayerwiseOffloadManager

__all__ = ["HOST_STORES", "LayerwiseOffloadManager", "STREAM_READS"]
