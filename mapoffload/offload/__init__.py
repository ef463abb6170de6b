"""Layerwise offload: the top layer, over the page cache and host memory.

``LayerwiseOffloadManager`` (``manager``: also the options completed with what the host measures, and
the working buffers ``summary()`` counts) is a facade over one stack's parts (``parts``: made and closed
together, ``manager.parts``):

- ``plan``, ``stores``: which host store each weight gets, and the stores themselves; ``holders``,
  ``placeholder``: what a weight's holders (``module._parameters[attr]``) hold, loaded or released.
- ``sequencer``: loaded and kept; prefetch / ensure / release (no hooks, no policy: when a layer loads
  is the runtime's step); the host weights read and replaced, by the manager's methods or by the user in the model
  (``adopt_edits``).
- ``runtime``: one stack's forward - the layer turn, the hooks torch calls and the per-forward policy
  they run, the mapped weights outside the layers (``OutsideWeights``), autograd's rule; ``hooks``: what
  is put on the model's modules (eager hooks that refuse copies, the patch registry) and the errors
  several parts raise.
- where a layer computes and where its bytes come from: ``loads`` (the ``Load`` record, the target
  interface, in place, and the uncached source; the mapping is ``pagecache.read_source``) and
  ``device_copies`` (device buffers from its pool). The stack's pages (``pagecache.layer_pages``) and
  how its streamed layers are read (``pagecache.member``, the ``auto`` policy) are page-cache
  policy, in ``mapoffload.pagecache``.

``mapoffload.offload`` is also the Hugging Face entry point's name in ``mapoffload``'s namespace
(a lazy attribute there); this package stays importable as ``mapoffload.offload``.
"""

from .manager import HOST_STORES, READS, LayerwiseOffloadManager

__all__ = ["HOST_STORES", "LayerwiseOffloadManager", "READS"]
