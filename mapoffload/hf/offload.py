"""``mapoffload.offload``: stream an already built model's block lists and
place the rest, in one call.

The stacks (``find_block_lists``) are streamed by one
:class:`~mapoffload.LayerwiseOffloadManager` each. Everything else (embeddings,
final norm, head, the buffers inside the blocks such as rotary tables) is
placed on the device when it fits, or — its parameters — streamed as one more
unit when it does not. ``close()`` gives the model back whole: the managers
put the layers' real weights back, and placed tensors get their host data back
(the same objects as before, mapped views stay mapped views).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from ..memory.budget import host_memory
from ..memory.regions import tensor_bytes
from ._summary import OffloadRow
from ._args import RESTS
from .blocks import find_block_lists

if TYPE_CHECKING:
    import torch

    from ..offload import LayerwiseOffloadManager

__all__ = ["OffloadHandle", "OffloadRow", "offload"]



def _resolve_layers(model: torch.nn.Module, layers: Any) -> list[tuple[str, Any]]:
    import torch

    if isinstance(layers, str) and layers == "auto":
        found = find_block_lists(model)
        if not found:
            logger.info("%s has no repeated block list: everything is the rest (placed, or streamed "
                        "module by module when it does not fit)", type(model).__name__)
        return found
    if isinstance(layers, (str, torch.nn.ModuleList, torch.nn.Sequential)):
        layers = [layers]
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for item in layers:
        if isinstance(item, str):
            out.append((item, item))
        else:
            out.append((names.get(id(item), "layers"), item))
    return out


class OffloadHandle:
    """What :func:`offload` set up: its managers and the placed tensors.

    ``summary()`` describes it, ``close()`` undoes it (idempotent); it is a
    context manager.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.managers: dict[str, LayerwiseOffloadManager] = {}
        self._saved: list[tuple[Any, str, bool, Any]] = []  # (module or param, attr, is_param, host tensor)
        self._closed = False
        # For the summary: the host budget planned against, whether host_store
        # was the caller's, and the decision behind the rest ("rest"/"placed").
        self._available: int | None = None
        self._host_store_given = False
        self._notes: dict[str, str] = {}

    @property
    def rows(self) -> list[OffloadRow]:
        """One :class:`OffloadRow` per unit, measured now (empty once closed)."""
        from ._summary import buffers_row, placed_row, stack_row

        if self._closed:
            return []
        rows = []
        for path, m in self.managers.items():
            rows.append(stack_row(path, m, available=self._available, host_store_given=self._host_store_given,
                                  modules=path == "rest", why=self._notes.get(path) if path == "rest" else None))
        placed = "placed" if "rest" in self.managers else "rest"  # as _place_rest names it
        if placed in self._notes:
            managed = {id(w.param) for m in self.managers.values() for s in m.sequencer.stores for w in s.weights}
            params, buffers = _rest_tensors(self.model)
            tensors = [p for p in params if id(p) not in managed] + [b for _, _, b in buffers]
            originals = [host for _, _, _, host in self._saved]
            rows.append(placed_row(placed, tensors, originals, self.device, self._notes[placed]))
        buffers = buffers_row(self.managers.values(), self.model)
        if buffers is not None:
            rows.append(buffers)
        return rows

    def summary(self) -> str:
        """A table (≤ 100 columns): per unit where its bytes live (mapped, anonymous, pinned, on the
        device), how it computes (streamed, in place, placed), what each forward re-reads from the file;
        a totals line against a full host copy; then one paragraph per unit saying why."""
        from ._summary import conversion_words, format_rows, fp8_words

        if self._closed:
            return f"{type(self.model).__name__}: offload closed, the model is whole again"
        return format_rows(self.rows, self.device) + fp8_words(self.model) + conversion_words(self.model)

    def name_calls(self, close_call: str, reload_call: str | None = None) -> None:
        """What the placeholders' errors tell a user to call: ``close_call`` gives
        the model back (``"model.mapoffload_handle.close()"`` after from_pretrained),
        ``reload_call`` (with ``{dtype}``) loads it in another dtype."""
        for m in self.managers.values():
            m.close_call, m.reload_call = close_call, reload_call

    def close(self) -> None:
        """Give the model back whole: layers' real weights, placed tensors' host data."""
        if self._closed:
            return
        for m in self.managers.values():
            m.close()
        for owner, attr, is_param, host in reversed(self._saved):
            if is_param:
                owner.data = host
            else:
                owner._buffers[attr] = host
        self._saved.clear()
        self._closed = True
        if self.model.__dict__.get("mapoffload_handle") is self:
            self.model.__dict__["mapoffload_handle"] = None  # never left naming a closed handle (None: no offload)

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OffloadHandle({type(self.model).__name__} on {self.device}:\n{self.summary()})"


def _rest_tensors(model: torch.nn.Module) -> tuple[list[Any], list[tuple[Any, str, Any]]]:
    """Parameters not held by a manager (placeholders and, in place, the managed real
    parameters skipped; each object once) and every buffer, as (module, name, tensor)."""
    from ..offload.placeholder import managed

    params, seen = [], set()
    buffers = []
    for module in model.modules():
        for p in module._parameters.values():
            if p is None or managed(p) or id(p) in seen:
                continue
            seen.add(id(p))
            params.append(p)
        for name, b in module._buffers.items():
            if b is not None:
                buffers.append((module, name, b))
    return params, buffers


def _leaf_owners(model: torch.nn.Module, params: list[Any]) -> list[torch.nn.Module]:
    """Leaf modules (no submodules) that directly hold rest parameters no other
    module holds. A parameter held by a module with submodules (CLIP's
    ``logit_scale``, ViT's ``cls_token``) is placed, not streamed: a unit's
    hooks would wrap the whole subtree."""
    holders: dict[int, list[torch.nn.Module]] = {}
    ids = {id(p) for p in params}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) in ids:
                holders.setdefault(id(p), []).append(module)
    shared = {id(m) for ms in holders.values() if len(ms) > 1 for m in ms}
    owners: dict[int, torch.nn.Module] = {}
    for ms in holders.values():
        if len(ms) == 1 and id(ms[0]) not in shared and next(ms[0].children(), None) is None:
            owners[id(ms[0])] = ms[0]
    return list(owners.values())


def offload(
    model: torch.nn.Module,
    *,
    device: str | torch.device,
    layers: Any = "auto",
    rest: str = "auto",
    prefetch_layers: int = 1,
    host_store: str | None = None,
    available_bytes: int | None = None,
    device_free_bytes: int | None = None,
    stream_reads: str = "auto",
) -> OffloadHandle:
    """Stream a model's block lists to ``device`` and place the rest there.

    Parameters
    ----------
    model
        A built model with real weights (mapped views or copies).
    device
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (the whole machinery runs; the
        rest stays where it is).
    layers
        ``"auto"`` (the repeated block lists, see :func:`find_block_lists`),
        an attribute path, a ``ModuleList``, or a list of those (one manager each).
    rest
        ``"auto"``: the parameters and buffers outside the stacks go to the
        device when they fit in its free memory (less what streaming needs),
        else their parameters are streamed as one more unit; ``"device"`` or
        ``"stream"`` force one way.
    prefetch_layers
        Layers copied ahead of the one running.
    host_store
        Passed to each manager; default ``"mapped"`` on ``cpu`` (a copy would
        buy nothing there) and ``"auto"`` on CUDA (pinned while the budget
        allows, mapped when copies would not fit).
    available_bytes, device_free_bytes
        Host budget and free device bytes to plan against (default: measured).
    stream_reads
        How streamed layers are read (``"auto"``, ``"mapping"``,
        ``"direct"``: around the page cache, on CUDA into pinned buffers
        copied by DMA; see :class:`~mapoffload.LayerwiseOffloadManager`).

    Returns
    -------
    OffloadHandle
        Also ``model.mapoffload_handle`` while it is open (its ``close()`` sets it to None).
    """
    import torch

    from ..offload import LayerwiseOffloadManager

    from ._args import check_device, check_offload_args

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload takes a built torch.nn.Module, not {type(model).__name__} (to load a folder: "
                        "mapoffload.from_pretrained(cls, folder, device=...))")
    if device is None:
        raise TypeError("offload needs a device: device='cuda', 'cuda:N' or 'cpu' (device=None, no offload, is for "
                        "from_pretrained and pipeline_from_pretrained)")
    check_device(device)
    check_offload_args(layers=layers, rest=rest, prefetch_layers=prefetch_layers, host_store=host_store,
                       stream_reads=stream_reads)
    _refuse_offloaded(model)
    if model.training:
        warnings.warn(
            f"{type(model).__name__} is in train mode: dropout changes its outputs. Call model.eval() first.",
            stacklevel=2,
        )
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    chosen = host_store is not None
    if host_store is None:
        host_store = "mapped" if dev.type == "cpu" else "auto"
    host = host_memory()
    available = host.available if available_bytes is None else available_bytes
    handle = OffloadHandle(model, dev)
    handle._available, handle._host_store_given = available, chosen
    try:
        for path, stack in _resolve_layers(model, layers):
            m = LayerwiseOffloadManager(
                model, stack, device=dev, prefetch_layers=prefetch_layers, host_store=host_store,
                available_bytes=available, stream_reads=stream_reads,
            )
            m.register_forward_hooks()
            handle.managers[path] = m
        _place_rest(handle, rest, prefetch_layers, host_store, available, device_free_bytes, stream_reads)
        handle.name_calls("handle.close()")
    except BaseException:
        handle.close()
        raise
    object.__setattr__(model, "mapoffload_handle", handle)  # the live handle (close() sets it to None)
    logger.info("offload of %s:\n%s", type(model).__name__, handle.summary())
    return handle


def _refuse_offloaded(model: torch.nn.Module) -> None:
    """An offloaded model is refused before anything is built, naming what holds it."""
    from ..offload.placeholder import AlreadyOffloadedError, offloaded_by

    for name, p in model.named_parameters():
        taken, holder = offloaded_by(p)
        if taken:
            raise AlreadyOffloadedError(
                f"{type(model).__name__} is already offloaded by {holder!r} ({name} is one of its weights); "
                "close its handle first (handle.close(), or model.mapoffload_handle.close() after "
                "mapoffload.from_pretrained)"
            )


def _place_rest(handle: OffloadHandle, rest: str, prefetch: int, host_store: str, available: int,
                device_free_bytes: int | None, stream_reads: str) -> None:
    import torch

    from ..offload import LayerwiseOffloadManager

    model, dev = handle.model, handle.device
    params, buffers = _rest_tensors(model)
    rest_bytes = sum(tensor_bytes(p) for p in params)
    buffer_bytes = sum(tensor_bytes(b) for _, _, b in buffers)
    streaming = max((m.layer_bytes(i) for m in handle.managers.values() for i in range(len(m.layers))), default=0)
    streaming *= prefetch + 1
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0] if device_free_bytes is None else device_free_bytes
    else:
        free = None
    need = rest_bytes + buffer_bytes + streaming
    fits = free is None or need <= free
    mode = rest if rest != "auto" else ("device" if fits else "stream")
    room = (
        "device is the CPU" if free is None
        else f"{format_bytes(need)} needed (with {format_bytes(streaming)} for streamed layers), "
             f"{format_bytes(free)} free on {dev}"
    )
    if mode == "stream":
        owners = _leaf_owners(model, params)
        if owners:
            m = LayerwiseOffloadManager(model, owners, device=dev, prefetch_layers=prefetch,
                                        host_store=host_store, available_bytes=available, stream_reads=stream_reads)
            m.register_forward_hooks()
            handle.managers["rest"] = m
            handle._notes["rest"] = f"rest={rest!r}: {room}" if rest == "stream" else f"does not fit: {room}"
        params, buffers = _rest_tensors(model)  # what is left: shared weights, buffers
        rest_bytes = sum(tensor_bytes(p) for p in params)
    moved = 0
    for p in params:
        if p.device != dev:
            handle._saved.append((p, "", True, p.data))
            p.data = p.data.to(dev)
            moved += tensor_bytes(p)
    for module, name, b in buffers:
        if b.device != dev:
            handle._saved.append((module, name, False, b))
            module._buffers[name] = b.to(dev)
    why = room if mode == "device" else "shared weights and buffers are placed, never streamed"
    if mode == "device" and rest == "device":
        why = f"rest='device': {room}"
    if dev.type == "cpu" and mode == "device":
        why = "the parameters and buffers outside the stacks stay where they are"
    handle._notes["placed" if "rest" in handle.managers else "rest"] = why
