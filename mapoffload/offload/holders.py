"""A stack's holders: what each managed weight's holders (its ``module._parameters[attr]``) hold.

In place (``device="cpu"``) a holder always holds the real parameter, its data the host tensor (the
mapped view itself); a placeholder only stands in for it while a conversion runs
(:func:`~mapoffload.offload.placeholder.stand_in`). On the device path a holder holds the real
parameter with its device data while the layer is loaded, and the shape-correct placeholder
otherwise. Engaged, the holders follow the loads; disengaged (``remove_forward_hooks``, ``close``),
every holder holds the real parameter with its host data: the model is whole.

What the holders were last given is recorded on each weight (``held``, and ``bound``: where the
parameter's data was then), so that a user's edit between forwards - a holder given another parameter
(``layer.weight = nn.Parameter(new)``, ``load_state_dict(..., assign=True)``) or the parameter given
other data (``layer.weight.data = new``) - is found (:meth:`Holders.edits`) and adopted or refused
(:func:`~mapoffload.offload.sequencer.adopt_edits`) before anything binds over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .stores import LayerStore, Weight

if TYPE_CHECKING:
    import torch

__all__ = ["Holders", "data_key"]


def data_key(t: torch.Tensor) -> tuple:
    """Where a tensor's data is and how it is laid out: equal keys, the same data."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (each in-place write through it bumps it; writes through ``.data``
    do not); None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


class Holders:
    """What the holders of a stack's managed weights hold.

    Parameters
    ----------
    model
        The model (its conversions are guarded while the holders are engaged).
    stores
        The stack's layer stores (each weight with its holders, parameter and placeholder).
    in_place
        The layers compute from their host stores (``device="cpu"``): holders keep the real parameters.
    """

    def __init__(self, model: Any, stores: list[LayerStore], *, in_place: bool) -> None:
        self.model = model
        self.stores = stores
        self.in_place = in_place
        self.engaged = False  # the holders follow the loads
        self.closed = False  # never engaged again (the manager closed)

    def bind(self, w: Weight, data: torch.Tensor | None) -> None:
        """Its holders hold the real parameter with ``data``, or (None) with its host data in place, the placeholder
        on the device path."""
        if data is None:
            w.param.data = w.host  # never left pointing into a recycled device buffer
            target = w.param if self.in_place else w.placeholder
        else:
            w.param.data = data
            target = w.param
        for module, attr in w.holders:
            module._parameters[attr] = target
        self.note(w, target)

    def note(self, w: Weight, held: Any) -> None:
        """Record what ``w``'s holders hold now (``held``), where its parameter's data is and the parameter's
        version (its in-place writes: see :meth:`edits`)."""
        w.held = held
        w.bound = data_key(w.param)
        w.version = _version(w.param)

    def edits(self, store: LayerStore) -> list[tuple[Weight, list[Any]]]:
        """The weights of ``store`` the user changed since they were bound: ``(weight, what each of its
        holders hold now)`` (None where a holder was emptied; the parameter itself, for new ``.data``)."""
        out = []
        for w in store.weights:
            if w.held is None:
                continue  # never bound: the manager is still being made
            now = [module._parameters.get(attr) for module, attr in w.holders]
            if any(p is not w.held for p in now):
                out.append((w, now))
            elif data_key(w.param) != w.bound or (not self.in_place and _version(w.param) != w.version):
                # On the device path a write into the parameter (load_state_dict without assign, an
                # in-place op under no_grad) lands in a device buffer the next release recycles: it is
                # taken into the host store like a replacement. In place the parameter's data is the host
                # store itself, so the write is already the weight.
                out.append((w, [w.param] * len(now)))
        return out

    def engage(self) -> None:
        """Bind every holder as released (placeholders on the device path) and guard the model's conversions.

        Idempotent; raises once closed.
        """
        if self.closed:
            raise RuntimeError("this LayerwiseOffloadManager is closed")
        if self.engaged:
            return
        from .placeholder import guard_conversions, stand_in  # imports torch

        for s in self.stores:
            for w in s.weights:
                self.bind(w, None)
                if self.in_place:
                    stand_in(w.param, w.placeholder)  # answers conversions for the real parameter

        guard_conversions(self.model)  # model.to(dtype) refuses before converting anything
        self.engaged = True

    def disengage(self) -> None:
        """Give the model its real parameters back (host data); the layers were released before."""
        from .placeholder import stand_in, unguard_conversions

        for s in self.stores:
            for w in s.weights:
                if data_key(w.param) == w.bound:  # else new .data the user gave it, refused: it stays theirs
                    w.param.data = w.host
                stand_in(w.param, None)
                for module, attr in w.holders:
                    if module._parameters.get(attr) is w.held:  # a refused edit stays the user's
                        module._parameters[attr] = w.param
                self.note(w, w.param)

        unguard_conversions(self.model)
        self.engaged = False
