"""Layerwise offload: the top layer, over the page cache and host memory.

``LayerwiseOffloadManager`` (``manager``) is a facade over these parts:

- ``options``: every knob validated once; ``plan``, ``stores``: which host store each weight gets and
  the stores themselves; ``slots``, ``placeholder``: what a parameter slot holds, loaded or released;
  ``grads``: autograd through managed layers.
- ``parts``: one stack's parts, made and closed together.
- ``sequencer``: loaded, kept, the streaming window; enter / exit / prefetch / release (no hooks, no
  policy). ``steps``: the per-forward policy the hooks run; ``turn``: the layer turn and the hooks.
- targets x sources: where a layer computes - ``loads`` (the ``Load`` record; in place) or
  ``device_copies`` (device buffers, ``device_pool``) - and where its bytes come from - ``sources``
  (the mapping, or read around the page cache); ``buffers``: what they hold on the host.
- ``layer_pages``: the stack's spans, files, page reads and let-gos; ``rest``: the mapped weights
  outside the layers; ``stream_reads``: how streamed layers are read (the ``auto`` policy).
- ``host_edits``: the host weights read and replaced, by the manager's methods or by the user in the
  model (``adopt_edits``).

``mapoffload.offload`` is also the Hugging Face entry point's name in ``mapoffload``'s namespace
(a lazy attribute there); this package stays importable as ``mapoffload.offload``.
"""

from .manager import HOST_STORES, STREAM_READS, LayerwiseOffloadManager

__all__ = ["HOST_STORES", "LayerwiseOffloadManager", "STREAM_READS"]
