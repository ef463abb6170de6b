"""A stack's parameter slots: what each managed weight's ``module._parameters[attr]`` holds.

In place (``device="cpu"``) a slot always holds the real parameter, its data the host tensor (the
mapped view itself); a placeholder only stands in for it while a conversion runs
(:func:`~mapoffload.offload.placeholder.stand_in`). On the device path a slot holds the real
parameter with its device data while the layer is loaded, and the shape-correct placeholder
otherwise. Engaged, the slots follow the loads; disengaged (``remove_forward_hooks``, ``close``),
every slot holds the real parameter with its host data: the model is whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .stores import LayerStore, Weight

if TYPE_CHECKING:
    import torch

__all__ = ["Slots"]


class Slots:
    """The parameter slots of a stack's managed weights.

    Parameters
    ----------
    model
        The model (its conversions are guarded while the slots are engaged).
    stores
        The stack's layer stores (each weight with its slots, parameter and placeholder).
    in_place
        The layers compute from their host stores (``device="cpu"``): slots keep the real parameters.
    """

    def __init__(self, model: Any, stores: list[LayerStore], *, in_place: bool) -> None:
        self.model = model
        self.stores = stores
        self.in_place = in_place
        self.engaged = False  # the slots follow the loads
        self.closed = False  # never engaged again (the manager closed)

    def bind(self, w: Weight, data: torch.Tensor | None) -> None:
        """Slots hold the real parameter with ``data``, or (None) with its host data in place, the placeholder
        on the device path."""
        if data is None:
            w.param.data = w.host  # never left pointing into a recycled device buffer
            target = w.param if self.in_place else w.placeholder
        else:
            w.param.data = data
            target = w.param
        for module, attr in w.slots:
            module._parameters[attr] = target

    def engage(self) -> None:
        """Bind every slot as released (placeholders on the device path) and guard the model's conversions.

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
                w.param.data = w.host
                stand_in(w.param, None)
                for module, attr in w.slots:
                    module._parameters[attr] = w.param

        unguard_conversions(self.model)
        self.engaged = False
