"""Autograd through managed layers: exact in place, refused on the device path.

In place (``device="cpu"``) a layer computes from its host tensors - the
mapped views, the model's own parameters - which stay where they are after
the layer ran: autograd may save them for a backward, and gradients (with
respect to inputs or weights) are exact. A layer read ahead into a reused
read-around buffer is read again through its mapping when it runs with
autograd recording (the manager asks :meth:`InPlace.reuses`).

On the device path (CUDA, the CPU twin) a layer computes from device
buffers that return to a pool when it is released and that the next layers
are copied into: a graph recorded through them would compute a backward
from other layers' weights, silently wrong. Such a forward is refused with
:class:`OffloadedGradientError` (a ``RuntimeError``) naming the layer and
why, before the wrong graph can be used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .stores import LayerStore

__all__ = ["OffloadedGradientError", "refuse_recorded_graph", "refuse_weight_gradients"]

WEIGHTS_REQUIRE_GRAD = "weights require grad"
RECORDED = "autograd recorded"

_HOW = ("Run the model under torch.no_grad() or torch.inference_mode() (the device path is for inference), or "
        "take gradients with device='cpu', which computes in place from the host tensors (exact)")


class OffloadedGradientError(RuntimeError):
    """A forward on the device path that would record autograd through reused device buffers.

    ``layer`` is the layer's index, ``name`` its path in the model and
    ``reason`` one of ``"weights require grad"`` (autograd enabled and the
    layer's weights require grad: refused before the layer is loaded) or
    ``"autograd recorded"`` (its output requires grad: the inputs did, and
    autograd saved the layer's device weights for the backward).
    """

    def __init__(self, message: str, *, layer: int, name: str, reason: str) -> None:
        super().__init__(message)
        self.layer, self.name, self.reason = layer, name, reason


def refuse_weight_gradients(store: LayerStore) -> None:
    """On the device path with autograd enabled: refuse layer ``store`` when its weights require grad."""
    if any(w.param.requires_grad for w in store.weights):
        raise OffloadedGradientError(
            f"layer {store.index} ({store.name}) ran with autograd recording and weights that require grad: on "
            "the device pipeline its weights are device buffers that later layers overwrite, so gradients "
            f"through them would be wrong. {_HOW}",
            layer=store.index, name=store.name, reason=WEIGHTS_REQUIRE_GRAD,
        )


def refuse_recorded_graph(store: LayerStore, output: Any) -> None:
    """On the device path: refuse a layer output autograd recorded (it saved views of device buffers)."""
    import torch
    from torch.utils._pytree import tree_leaves

    if not torch.is_grad_enabled():
        return
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output)):
        raise OffloadedGradientError(
            f"layer {store.index} ({store.name}) recorded autograd through the device pipeline: autograd saved "
            "its weights, views of device buffers that later layers overwrite, so a backward (input gradients "
            f"included) would compute from other layers' weights. {_HOW}",
            layer=store.index, name=store.name, reason=RECORDED,
        )
