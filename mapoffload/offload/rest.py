"""The weights outside a manager's layers ("the rest": embedding, head,
norms) that a forward reads from the checkpoint's mapping, checked before
each forward.

Every forward reads the rest before the first layer's own check (the
embedding first of all). A file truncated under the mapping would make that
read a SIGBUS that kills the process; a check of the mapped file's size
(``fstat`` of a descriptor on the mapped inode, ``_mapped_file.py``) turns it
into a :class:`~mapoffload.MappingFaultError` naming the file. The spans are
found again only when the rest's tensors change (moved to a device, replaced).

Where the page-cache plan finds no room for the weights every forward reads whole (a head, norms)
beside the streaming window (``ResidencyPlan.rest_streamed``), they are streamed like a layer: each
module holding them reads them in before it runs (where they fit the room; else its own faults read
them, 2 MiB folios at a time under ``MADV_HUGEPAGE`` + ``MADV_RANDOM``) and lets them go after it ran,
so that they never push the layers' pages out, nor stay in the way of the next forward's.

The rest's lookup tables (embeddings no head shares) are set ``MADV_RANDOM``:
a lookup faults a few rows, and a fault's read-around (the disk's
``read_ahead_kb``: 8 MiB on this project's machine) read 131-216 MiB of a
125 MiB table per forward under a tight cap, for 128 rows of 4 KiB. The
advice is set back when the guard closes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._log import format_bytes, logger
from .._native import _core
from ..pagecache.mapped_file import MappedFiles
from ..pagecache.pages import Extent, PageWorker, check_extents, file_extents, layer_spans

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

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module], files: MappedFiles,
                 worker: PageWorker | None = None) -> None:
        self._model = model
        self._layers = layers
        self._files = files
        self._worker = worker  # the stack's page worker: streams the always-read weights (stream())
        self._streamed: list = []  # what puts each streamed module back (its hooks)
        self._stream_key: tuple | None = None  # (the rest's key, the unit) it was streamed for
        self.streamed_bytes = 0
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
        """Set the lookup tables' advice back, stop streaming the always-read weights. Idempotent."""
        self._unadvise()
        self.stream(False)

    # -- the always-read weights streamed --------------------------------------------------------
    @property
    def streaming(self) -> bool:
        """Whether the always-read weights are streamed now (see :meth:`stream`)."""
        return bool(self._streamed)

    def stream(self, on: bool, unit: int = 0) -> None:
        """Stream the weights outside the layers that every forward reads whole (``on``), or keep them
        cached as the kernel does (``off``): each module holding them reads them in before it runs and
        lets them go after; one whose weights exceed ``unit`` bytes (the plan's streaming window: a layer,
        or a part) is read by its own faults instead of in one read. Idempotent; hooks and advice are
        put back when it stops."""
        if not on:
            for undo in self._streamed:
                undo()
            self._streamed, self.streamed_bytes = [], 0
            return
        if self._streamed and (self._key, unit) != self._stream_key:
            self.stream(False)  # the rest's tensors or the plan's unit changed since: streamed afresh
        if self._streamed or self._worker is None:
            return
        self._stream_key = (self._key, unit)
        from ..pagecache.file_places import MapsView
        from .plan import _is_lookup, always_read_tensors, modules_outside

        whole = {t.data_ptr() for t, _ in always_read_tensors(self._model, self._layers)}
        names = {id(m): n for n, m in self._model.named_modules()}
        maps = MapsView()
        for module in modules_outside(self._model, self._layers):
            if _is_lookup(module):
                continue  # a lookup reads its rows (MADV_RANDOM), not the table: a head it is tied to reads it
            mine = [p.data for p in module._parameters.values() if p is not None and p.data_ptr() in whole]
            if mine:
                name = names.get(id(module)) or type(module).__name__
                job = _StreamedModule(module, name, mine, self._worker, self._files, maps, unit)
                self._streamed.append(job.remove)
                self.streamed_bytes += job.bytes
        if self._streamed:
            logger.info("%s: %s read every forward are streamed (read in as their modules run, let go after)",
                        WHAT, format_bytes(self.streamed_bytes))

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


class _StreamedModule:
    """One module's always-read weights streamed: read in before it runs, let go after.

    Where they are larger than ``unit`` (the plan's streaming window), reading them in whole would push
    out the pages the plan keeps: the module's own faults read them as it computes (advised by the page
    worker), and they are let go after. The module computes as it would without a manager (one matmul:
    a matmul over chunks of a head's rows was not bit-equal to the whole one with more than one thread).

    Its hooks are :class:`~.eager.Hook` s: a model is not copied or pickled while they are on (as the
    layers' hooks)."""

    def __init__(self, module, name: str, tensors, worker: PageWorker, files: MappedFiles, maps, unit: int) -> None:
        from ..memory.regions import tensor_extent
        from ..pagecache.pages import folio_edges
        from .eager import Hook

        self.module, self.worker, self.files, self.unit = module, worker, files, unit
        self.spans = layer_spans([tensor_extent(t) for t in tensors])
        self.extents = file_extents(self.spans, files, maps)
        self.edges = folio_edges(self.spans, maps)
        self.bytes = self.spans.total_bytes
        self.read_whole = not unit or self.bytes <= unit
        worker.advise(self.spans, self.extents)
        if not self.read_whole:
            logger.info("%s (%s) does not fit the %s the page-cache plan streams in: read by its own faults as "
                        "it computes, let go after", name, format_bytes(self.bytes), format_bytes(unit))
        self._undo = [module.register_forward_pre_hook(Hook(self.before)).remove,
                      module.register_forward_hook(Hook(self.after), always_call=True).remove]

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []
        _core.advise_random(self.spans, False)

    def before(self, module, args) -> None:
        if self.read_whole:
            self.worker.read_in(self.spans, WHAT, self.edges, self.extents).result()

    def after(self, module, args, output) -> None:
        self.worker.let_go(self.spans, self.extents)
        self.worker.drain()  # done before anything can write the weights in place (PageWorker.drain)
