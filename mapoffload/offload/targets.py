"""The load target a stack computes through, chosen in one place.

In place (``device="cpu"`` without the CPU twin): :class:`~.loads.InPlace`, the layers compute from
their host stores. Else :class:`~.device_copies.DeviceCopies`: device buffers the copier fills (on
CUDA, or the CPU twin's separate CPU buffers). Both are :class:`~.loads.Target`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .device_copies import DeviceCopies
from .loads import InPlace, Target

if TYPE_CHECKING:
    from ..copier import Copier
    from ..options import OffloadOptions
    from ..pagecache.layer_pages import LayerPages
    from .stores import LayerStore

__all__ = ["Target", "load_target"]


def load_target(o: OffloadOptions, stores: list[LayerStore], pages: LayerPages, copier: Copier | None, *,
                owns_copier: bool) -> Target:
    """The target for options ``o``: in place, or device buffers holding the most layers loaded at once
    (resident, the one computing, the prefetched ones) copied by ``copier``."""
    if o.in_place:
        return InPlace(stores, pages)
    assert copier is not None, "a device target needs a copier"
    return DeviceCopies(stores, pages, o.device, copier, owns_copier=owns_copier,
                        side_stream=copier.mode != "direct",  # direct: the seed's path, on the compute stream
                        buffer_layers=o.resident_layers + 1 + o.prefetch_layers)
