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
        self._streamed: list = []  # what puts each streamed module back (its hooks, its chunked forward)
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
        lets them go after; a linear layer whose weight exceeds ``unit`` bytes (the plan's streaming
        window: a layer, or a part) is computed ``unit`` bytes of its rows at a time, each read in and
        let go in turn. Idempotent; hooks, forwards and advice are put back when it stops."""
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
    """One module's always-read weights streamed: read in before it runs, let go after; a linear layer
    larger than ``unit`` computed a chunk of its rows at a time (each chunk read in, then let go).

    Its hooks and chunked forward are :class:`~.turn._Hook` s: a model is not copied or pickled while
    they are on (as the layers' hooks). A weight replaced since (another shape, another tensor) is
    chunked afresh at the next call: the chunks are always the weight's that computes."""

    def __init__(self, module, name: str, tensors, worker: PageWorker, files: MappedFiles, maps, unit: int) -> None:
        import torch

        from ..memory.regions import tensor_extent
        from ..pagecache.pages import folio_edges
        from .patches import install
        from .turn import _eager, _Hook

        self.module, self.worker, self.files, self.unit = module, worker, files, unit
        self.spans = layer_spans([tensor_extent(t) for t in tensors])
        self.extents = file_extents(self.spans, files, maps)
        self.edges = folio_edges(self.spans, maps)
        self.bytes = self.spans.total_bytes
        worker.advise(self.spans, self.extents)
        weight = getattr(module, "weight", None)
        # Chunked: a plain nn.Linear (no forward of its own, on the class or the instance) larger than unit.
        chunked = (type(module).forward is torch.nn.Linear.forward and "forward" not in vars(module)
                   and unit > 0 and self.bytes > unit and self._rows(weight) > 0)
        if not chunked and weight is not None and self.bytes > unit and weight.dtype != torch.float32:
            logger.info("%s (%s, %s) does not fit the %s the page-cache plan streams in, but is read whole: a "
                        "matmul over chunks of its rows is bit-equal to the whole one for float32 only", name,
                        format_bytes(self.bytes), str(weight.dtype).replace("torch.", ""), format_bytes(unit))
        self.chunks: list = []  # (first row, end row, spans, extents, edges) of each chunk
        self._chunked_for: tuple | None = None  # the weight the chunks are of (address, shape, stride)
        self._undo = []
        if chunked:
            self._chunk(weight, maps)
            install(module, "forward", _Hook(_eager(self.chunked_forward), None))
            self._undo.append(lambda: _uninstall_forward(module))
            logger.info("%s (%s) does not fit the %s the page-cache plan streams in: computed %d rows at a "
                        "time, each chunk read in and let go after", name,
                        format_bytes(self.bytes), format_bytes(unit), self._rows(weight))
        else:
            self._undo.append(module.register_forward_pre_hook(_Hook(_eager(self.before), None)).remove)
            self._undo.append(module.register_forward_hook(_Hook(_eager(self.after), None), always_call=True).remove)

    def _rows(self, weight) -> int:
        """Rows of a chunk of ``weight`` (a multiple of ``CHUNK_ROWS``); 0: not chunked (not a contiguous
        matrix, or one chunk would hold it all)."""
        import torch

        if (weight is None or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu"
                or weight.dtype != torch.float32):
            return 0
        row = max(1, weight.shape[1] * weight.element_size())
        rows = max(CHUNK_ROWS, self.unit // row // CHUNK_ROWS * CHUNK_ROWS)
        return rows if rows < weight.shape[0] else 0

    def _chunk(self, weight, maps=None) -> None:
        """The chunks of ``weight``'s rows and their pages (``maps``: the snapshot to find them in)."""
        from ..pagecache.file_places import MapsView
        from ..pagecache.pages import folio_edges

        maps = MapsView() if maps is None else maps
        rows = self._rows(weight)
        self.chunks = []
        for first in range(0, weight.shape[0], rows or weight.shape[0]):
            w = weight[first:first + rows] if rows else weight
            spans = layer_spans([(w.data_ptr(), w.numel() * w.element_size())])
            self.chunks.append((first, first + w.shape[0], spans, file_extents(spans, self.files, maps),
                                folio_edges(spans, maps)))
        self._chunked_for = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []
        _core.advise_random(self.spans, False)

    def before(self, module, args) -> None:
        self.worker.read_in(self.spans, WHAT, self.edges, self.extents).result()

    def after(self, module, args, output) -> None:
        self.worker.let_go(self.spans, self.extents)

    def chunked_forward(self, x):
        """``nn.Linear.forward`` over chunks of the weight's rows, each read in before its matmul and let
        go after: the room the weight takes is one chunk's.

        The matmul library may reduce in another order for a narrower output: bit-equal for float32 with
        chunks of 512 rows and more (measured), not for bfloat16 nor under autocast; and autograd would
        sum the input's gradient over the chunks. So the whole matmul runs (read by its own faults) for
        another dtype, under autocast, while autograd records, or once the weight was replaced by one
        that is not chunked (small, strided, elsewhere)."""
        import torch
        import torch.nn.functional as F

        weight, bias = self.module.weight, self.module.bias
        if (not self._rows(weight) or x.dtype != torch.float32 or _autocast()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                 or (bias is not None and bias.requires_grad)))):
            return F.linear(x, weight, bias)
        if self._chunked_for != (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype):
            self._chunk(weight)  # replaced since: the chunks are the new weight's
        out = None
        for first, end, spans, extents, edges in self.chunks:
            self.worker.read_in(spans, WHAT, edges, extents).result()
            try:
                piece = F.linear(x, weight[first:end], None if bias is None else bias[first:end])
            finally:
                self.worker.let_go(spans, extents)
            if out is None:
                out = piece.new_empty((*piece.shape[:-1], weight.shape[0]))
            out[..., first:end] = piece
        return out


CHUNK_ROWS = 512  # a chunk of a streamed linear layer's rows: a multiple of this


def _uninstall_forward(module) -> None:
    from .patches import uninstall

    uninstall(module, "forward")


def _autocast() -> bool:
    """Whether autocast is on for the CPU (torch >= 2.4 ``is_autocast_enabled("cpu")``, older ``is_autocast_cpu_enabled``)."""
    import torch

    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:
        return torch.is_autocast_cpu_enabled()
