"""The per-forward policy around the sequencer: what the hooks (``turn.py``) run.

Once per forward of the model (before anything reads the mapping): follow the cap, count the forward
for the page-cache coordinator, let the ``reads`` policy choose, check the mapped weights
outside the layers. Per layer: autograd's rule (refused on reused device buffers; in place, a layer
read ahead into a reused read-around buffer is read again through its mapping), the streaming window
the plan allows, then the sequencer's step; after the layer, its release and the recorded-graph check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..pagecache.coordinator import coordinator
from .grads import refuse_recorded_graph, refuse_weight_gradients

if TYPE_CHECKING:
    from ..pagecache.member import StackMember
    from .rest import RestGuard
    from .sequencer import Sequencer
    from ..pagecache.read_policy import ReadPolicy

__all__ = ["Steps"]


class Steps:
    """The hooks' work for one stack: :meth:`before_forward`, :meth:`start`, :meth:`finish`, :meth:`after`.

    Parameters
    ----------
    sequencer
        The stack's sequencer (its loads, stores and window).
    member
        The stack's page-cache member (its plan, its forwards counted).
    reads
        The stack's ``reads`` policy.
    rest
        The mapped weights outside the layers, checked once per forward.
    in_place
        The layers compute from their host stores (``device="cpu"``).
    """

    def __init__(self, sequencer: Sequencer, member: StackMember, reads: ReadPolicy, rest: RestGuard, *,
                 in_place: bool) -> None:
        self.sequencer = sequencer
        self.member = member
        self.reads = reads
        self.rest = rest
        self.in_place = in_place

    def before_forward(self, module: Any, args: Any) -> None:
        """Once per forward of the model: follow the cap, check the mapped weights outside the layers."""
        coordinator().follow_cap()
        coordinator().note_forward(self.member)
        self.reads.choose()
        self.rest.check()

    def start(self, i: int) -> None:
        """The pre-hook's work, holding the turn: load layer ``i``, start the read-ahead."""
        import torch

        seq = self.sequencer
        if torch.is_grad_enabled():
            if not self.in_place:
                refuse_weight_gradients(seq.stores[i])
            elif i in seq.loaded and seq.loads.reuses(seq.loaded[i]):
                seq.release(i)  # read ahead into a reused buffer: autograd reads it through its mapping
        seq.enter(i, seq.window(i, self.member.residency))

    def finish(self, i: int) -> None:
        """Layer ``i`` is done (its post-hook, or whatever left it): released unless it stays."""
        self.sequencer.exit(i)

    def after(self, i: int, output: Any) -> None:
        """After layer ``i`` computed: autograd must not have saved views of reused device buffers."""
        seq = self.sequencer
        if seq.loads.recycles(i):
            refuse_recorded_graph(seq.stores[i], output)
