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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from ..memory.budget import host_memory
from ..memory.regions import tensor_bytes
from ..offload.hooks import CallNames
from ..options import OffloadOptions, caller_stacklevel, gather, shows_option_keywords
from ._summary import OffloadRow
from .blocks import find_block_lists

if TYPE_CHECKING:
    import torch

    from ..offload import LayerwiseOffloadManager

__all__ = ["OffloadHandle", "OffloadRow", "offload", "offload_with"]



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
        elif id(item) in names:
            out.append((names[id(item)], item))
        else:
            raise ValueError(f"layers: a {type(item).__name__} of {len(item)} modules that is not part of "
                             f"{type(model).__name__}: name one of its own block lists (an attribute path, "
                             "or the list itself)")
    return out


def _always_streamed_bytes(managers: Iterable[LayerwiseOffloadManager]) -> int:
    """Bytes of the weights outside the stacks (a head) that each forward reads in as their modules
    run and lets go after, because the page-cache plan leaves them no room beside the streaming window
    (``ResidencyPlan.always_streamed``): what the stack's guard streams once a forward set it up
    (:attr:`~mapoffload.offload.runtime.OutsideWeights.streamed_bytes`), the plan's always-read bytes before."""
    for m in managers:
        plan = m.residency
        if plan is not None and plan.always_streamed:
            return m.parts.outside.streamed_bytes if m.parts.outside.streaming else plan.always_bytes
    return 0


class OffloadHandle:
    """What an entry point offloaded: :func:`offload` on a model (its managers and the placed tensors),
    or :func:`~mapoffload.offload_pipeline` on a pipeline (``components``: one handle per model
    component, by name). Every entry point returns this one type.

    ``summary()`` describes it, ``close()`` undoes it (idempotent); it is a
    context manager.
    """

    def __init__(self, model: Any, options: OffloadOptions) -> None:
        self.model = model  # the model, or the pipeline
        self.options = options  # the host budget in it is the one every unit planned against
        self.device = options.device
        self.managers: dict[str, LayerwiseOffloadManager] = {}
        self._saved: list[tuple[Any, str, bool, Any]] = []  # (module or param, attr, is_param, host tensor)
        self._closed = False
        self._notes: dict[str, str] = {}  # for the summary: the decision behind the rest ("rest"/"placed")
        self.components: dict[str, OffloadHandle] = {}  # a pipeline's model components, each offloaded

    @property
    def pipeline(self) -> bool:
        """A pipeline's handle (not a module): its rows are its components', none of them maybe."""
        import torch

        return not isinstance(self.model, torch.nn.Module)

    @property
    def rows(self) -> list[OffloadRow]:
        """One :class:`OffloadRow` per unit, measured now (empty once closed); a pipeline's are its
        components' (``component`` set)."""
        from ._summary import buffers_row, placed_row, stack_row

        if self._closed:
            return []
        rows = []
        for name, h in self.components.items():
            for row in h.rows:
                row.component = name
                rows.append(row)
        if self.pipeline:  # nothing of its own
            return rows
        for path, m in self.managers.items():
            rows.append(stack_row(path, m, available=self.options.available_bytes,
                                  host_store_given=self.options.host_store != "auto",
                                  modules=path == "rest", why=self._notes.get(path) if path == "rest" else None))
        placed = "placed" if "rest" in self.managers else "rest"  # as _place_rest names it
        if placed in self._notes:
            managed = {id(w.param) for m in self.managers.values() for s in m.parts.sequencer.stores for w in s.weights}
            params, buffers = _rest_tensors(self.model)
            tensors = [p for p in params if id(p) not in managed] + [b for _, _, b in buffers]
            originals = [host for _, _, _, host in self._saved]
            rows.append(placed_row(placed, tensors, originals, self.device, self._notes[placed],
                                   streamed=_always_streamed_bytes(self.managers.values()) if placed == "rest" else 0))
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
        if self.pipeline:  # one table for the pipeline, grouped by component
            return format_rows(self.rows, self.device)
        return format_rows(self.rows, self.device) + fp8_words(self.model) + conversion_words(self.model)

    def close(self) -> None:
        """Give the model back whole (layers' real weights, placed tensors' host data), or every
        component of a pipeline."""
        if self._closed:
            return
        for h in self.components.values():
            h.close()
        for m in self.managers.values():
            m.close()
        for owner, attr, is_param, host in reversed(self._saved):
            if is_param:
                owner.data = host
            else:
                owner._buffers[attr] = host
        self._saved.clear()
        self._closed = True
        if getattr(self.model, "__dict__", {}).get("mapoffload_handle") is self:
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


@shows_option_keywords
def offload(model: torch.nn.Module, options: OffloadOptions | None = None, **keywords: Any) -> OffloadHandle:
    """Stream a model's block lists to the device and place the rest there.

    Parameters
    ----------
    model
        A built model with real weights (mapped views or copies).
    options
        An :class:`~mapoffload.OffloadOptions`: which block lists stream
        (``layers``), where the rest goes (``rest``), the device and the host
        stores - each field documented there.
    **keywords
        Its fields (``device=``, ``layers=``, ``prefetch_layers=``, ...), laid
        over ``options``: ``offload(model, device="cuda")``.

    Returns
    -------
    OffloadHandle
        Also ``model.mapoffload_handle`` while it is open (its ``close()`` sets it to None).
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload takes a built torch.nn.Module, not {type(model).__name__} (to load a folder: "
                        "mapoffload.from_pretrained(cls, folder, device=...))")
    if "device" in keywords and keywords["device"] is None:
        raise TypeError("offload needs a device: device='cuda', 'cuda:N' or 'cpu' (device=None, no offload, is for "
                        "from_pretrained and pipeline_from_pretrained)")
    return offload_with(model, gather("mapoffload.offload", options, keywords), CallNames("handle.close()"))


def offload_with(model: torch.nn.Module, options: OffloadOptions, calls: CallNames) -> OffloadHandle:
    """:func:`offload` with checked ``options``; the placeholders' errors name ``calls``."""
    from ..offload.manager import start_stacks

    _refuse_offloaded(model)
    if model.training:
        warnings.warn(
            f"{type(model).__name__} is in train mode: dropout changes its outputs. Call model.eval() first.",
            stacklevel=caller_stacklevel(),
        )
    if options.available_bytes is None:  # one figure for every unit of the model
        options = options.filled(available_bytes=host_memory().available)
    handle = OffloadHandle(model, options)
    try:
        stacks = _resolve_layers(model, options.layers)
        started = start_stacks(model, [(stack, options) for _, stack in stacks], calls=calls)
        handle.managers.update(zip([path for path, _ in stacks], started))
        _place_rest(handle, calls)
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


def _place_rest(handle: OffloadHandle, calls: CallNames) -> None:
    import torch

    from ..offload.manager import less_copies, start_stacks

    model, dev, o = handle.model, handle.device, handle.options
    rest, device_free_bytes = o.rest, o.device_free_bytes
    params, buffers = _rest_tensors(model)
    rest_bytes = sum(tensor_bytes(p) for p in params)
    buffer_bytes = sum(tensor_bytes(b) for _, _, b in buffers)
    streaming = max((m.parts.layer_bytes(i) for m in handle.managers.values() for i in range(len(m.layers))), default=0)
    streaming *= o.prefetch_layers + 1
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
            rest_options = less_copies(o, handle.managers.values())  # the stacks' copies are not its room
            handle.managers["rest"], = start_stacks(model, [(owners, rest_options)], calls=calls)
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
