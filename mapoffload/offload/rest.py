"""The weights outside a manager's layers ("the rest": embedding, head,
norms) that a forward reads from the checkpoint's mapping, checked before
each forward.

Every forward reads the rest before the first layer's own check (the
embedding first of all). A file truncated under the mapping would make that
read a SIGBUS that kills the process; a check of the mapped file's size
(``fstat`` of a descriptor on the mapped inode, ``_mapped_file.py``) turns it
into a :class:`~mapoffload.MappingFaultError` naming the file. The spans are
found again only when the rest's tensors change (moved to a device, replaced).

The rest's lookup tables (embeddings no head shares) are set ``MADV_RANDOM``:
a lookup faults a few rows, and a fault's read-around (the disk's
``read_ahead_kb``: 8 MiB on this project's machine) read 131-216 MiB of a
125 MiB table per forward under a tight cap, for 128 rows of 4 KiB. The
advice is set back when the guard closes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._log import logger
from .._native import _core
from ..pagecache.mapped_file import MappedFiles
from ..pagecache.pages import Extent, check_extents, file_extents, layer_spans

if TYPE_CHECKING:
    import torch

__all__ = ["RestGuard"]

WHAT = "the weights outside the managed layers"


def outside_tensors(model: torch.nn.Module, layers: list[torch.nn.Module]) -> tuple[list[torch.Tensor], tuple]:
    """CPU parameters and buffers of the modules outside ``layers`` that no manager offloads, each once;
    and a key of where they are held (module and address of each place, a tensor held twice
    counted twice: tying a head to an embedding changes it, though no tensor is added)."""
    from .placeholder import managed  # imports torch (the placeholders subclass nn.Parameter)
    from .plan import modules_outside

    seen: set[int] = set()
    out = []
    held = []
    for m in modules_outside(model, layers):
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is None or managed(t) or t.device.type != "cpu" or t.numel() == 0:
                continue
            held.append((id(m), t.data_ptr()))
            if id(t) in seen:
                continue
            seen.add(id(t))
            out.append(t.detach())
    return out, tuple(held)


class RestGuard:
    """Checks, before a forward, that the rest's mapped files still reach the bytes mapped from them."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module], files: MappedFiles) -> None:
        self._model = model
        self._layers = layers
        self._files = files
        self._key: tuple[int, ...] | None = None
        self._extents: list[Extent] = []
        self._advised = None  # the lookup tables' spans, MADV_RANDOM while the guard is open
        self.table_bytes = 0  # bytes of the lookup tables advised

    def _advise_tables(self) -> None:
        """``MADV_RANDOM`` (no huge pages) over the rest's lookup tables: a fault reads its own page."""
        from ..memory.regions import tensor_extent
        from .plan import lookup_tables

        self._unadvise()
        tables = lookup_tables(self._model, self._layers)
        if not tables:
            return
        spans = layer_spans([tensor_extent(t) for t in tables])
        err = _core.advise_random(spans, True, False)
        if err:
            logger.info("lookup tables keep the kernel's read-around (madvise MADV_RANDOM: errno %d)", err)
            _core.advise_random(spans, False)
            return
        self._advised = spans
        self.table_bytes = spans.total_bytes

    def _unadvise(self) -> None:
        if self._advised is not None:
            _core.advise_random(self._advised, False)
            self._advised, self.table_bytes = None, 0

    def close(self) -> None:
        """Set the lookup tables' advice back. Idempotent."""
        self._unadvise()

    def _refresh(self) -> None:
        from ..memory.regions import MappedRegions, tensor_extent  # one definition of a tensor's bytes

        tensors, key = outside_tensors(self._model, self._layers)  # the lookup tables depend on their holders too
        if key == self._key:
            return
        on_mapping = MappedRegions().classify(tensors)
        spans = layer_spans([tensor_extent(t) for t, m in zip(tensors, on_mapping) if m])
        self._extents = file_extents(spans, self._files)
        self._advise_tables()
        self._key = key

    def check(self) -> None:
        """Raise MappingFaultError when a mapped file of the rest was truncated under it."""
        self._refresh()
        check_extents(self._extents, WHAT)
