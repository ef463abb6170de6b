"""Layerwise offload: the top layer, over the page cache and host memory.

``LayerwiseOffloadManager`` (``manager``) is a facade over these parts:

- ``options``: the user's :class:`~mapoffload.OffloadOptions` completed with what the host measures; ``plan``, ``stores``: which host store each weight gets and
  the stores themselves; ``slots``, ``placeholder``: what a parameter slot holds, loaded or released;
  ``grads``: autograd through managed layers.
- ``parts``: one stack's parts, made and closed together.
- ``sequencer``: loaded, kept, the streaming window; enter / exit / prefetch / release (no hooks, no
  policy); the host weights read and replaced, by the manager's methods or by the user in the model
  (``adopt_edits``). ``runtime``: one stack's forward - the layer turn, the hooks torch calls and the per-forward
  policy they run; ``eager``: the hooks' objects (eager under ``torch.compile``, never copied).
- targets x sources: where a layer computes - ``loads`` (the ``Load`` record; in place) or
  ``device_copies`` (device buffers, ``device_pool``) - and where its bytes come from - ``sources``
  (the read-around source; the mapping is ``pagecache.read_source``); ``buffers``: what they hold on the host.
- ``rest``: the mapped weights outside the layers. The stack's pages (``pagecache.layer_pages``) and
  how its streamed layers are read (``pagecache.read_policy``, the ``auto`` policy) are page-cache
  policy, in ``mapoffload.pagecache``.

``mapoffload.offload`` is also the Hugging Face entry point's name in ``mapoffload``'s namespace
(a lazy attribute there); this package stays importable as ``mapoffload.offload``.
"""

from .manager import HOST_STORES, READS, LayerwiseOffloadManager

__all__ = ["HOST_STORES", "LayerwiseOffloadManager", "READS"]
