"""Planning for the layerwise offload manager: which parameters it manages
and which host store each one gets, against the host budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._log import logger
from .._progress import byte_bar
from ..memory.budget import host_copies_would_not_fit, host_copy_room, host_memory_available_bytes
from ..memory.regions import MappedRegions
from .hooks import patched
from .placeholder import AlreadyOffloadedError, OffloadedWeight, offloaded_by
from .stores import (
    CONSOLIDATED,
    MAPPED,
    STRIDED,
    LayerStore,
    Part,
    PinChoice,
    StorePlan,
    StoreRule,
    Weight,
    build_consolidated,
    build_strided,
    describe,
    layout,
    log_plan,
)

if TYPE_CHECKING:
    import torch



def resolve_layers(model: torch.nn.Module, layers: Any) -> list[torch.nn.Module]:
    """The layer modules, from an ``nn.ModuleList``/sequence or its attribute path."""
    import torch

    if isinstance(layers, str):
        obj: Any = model
        walked = []
        for part in layers.split("."):
            if not hasattr(obj, part):
                where = ".".join(walked) or type(model).__name__
                raise AttributeError(f"layer path {layers!r}: {where} has no attribute {part!r}")
            obj = getattr(obj, part)
            walked.append(part)
        layers = obj
    if not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)):
        raise TypeError(f"layers must be an nn.ModuleList or its attribute path, not {type(layers).__name__}")
    out = list(layers)
    if not all(isinstance(m, torch.nn.Module) for m in out):
        raise TypeError("every layer must be an nn.Module")
    return out


def modules_outside(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of ``model`` outside ``layers`` ("the rest": embedding, head, norms), in ``model.modules()``
    order: the one definition of "outside the layers" (ties, the weights every forward reads, the lookup
    tables, the outside weights' checks in ``runtime.py``)."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def stack_name(model: torch.nn.Module, given: Any, layers: list[torch.nn.Module]) -> str:
    """A stack's name for logs and summaries: its attribute path as given, else where ``layers`` sit in
    ``model``, else how many they are."""
    if isinstance(given, str):
        return given
    for name, module in model.named_modules():
        if module is layers:
            return name or type(model).__name__
    return f"{len(layers)} layers"


def _outside_parameters(model: torch.nn.Module, layers: list[torch.nn.Module]) -> set[int]:
    """ids of parameters that some module outside the layers also holds (ties)."""
    out: set[int] = set()
    for m in modules_outside(model, layers):
        out.update(id(p) for p in m._parameters.values() if p is not None)
    return out


def collect(model: torch.nn.Module, layers: list[torch.nn.Module], device: object = "cpu"
            ) -> tuple[list[LayerStore], list[str]]:
    """One :class:`LayerStore` per layer, and the names of weights left unmanaged.

    A weight a module outside the layers also holds (an embedding tied to a
    head inside the last block, say) is left where the model keeps it:
    offloading it would take it from the outside module too.

    Raises
    ------
    ValueError
        A parameter is shared by two layers, or still on the meta device.
    """
    prefix = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    outside = _outside_parameters(model, layers)
    owner: dict[int, int] = {}
    unmanaged: list[str] = []
    stores = []
    for i, layer in enumerate(layers):
        base = prefix.get(id(layer), f"layers.{i}")
        if "forward" in patched(layer):
            # Its forward is another manager's guard: one dropped without close() (its hooks stay on the
            # model, and keep streaming it); a second manager's hooks would run beside them, its plan unused.
            raise AlreadyOffloadedError(
                f"layer {base} is already offloaded: its forward is still wrapped by a LayerwiseOffloadManager's "
                "hooks (one dropped without close() keeps them on the model, and keeps offloading it); keep the "
                "manager and close() it (or use it as a context manager) before offloading the model again")
        store = LayerStore(i, base)
        by_id: dict[int, Weight] = {}
        for mod_name, module in layer.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                full = ".".join(x for x in (base, mod_name, attr) if x)
                if id(p) in outside:
                    unmanaged.append(full)
                    continue
                if id(p) in by_id:
                    w = by_id[id(p)]
                    if full not in w.names:
                        w.names.append(full)
                    if (module, attr) not in w.holders:
                        w.holders.append((module, attr))
                    continue
                if id(p) in owner and owner[id(p)] != i:
                    raise ValueError(f"parameter {full} is shared by layers {owner[id(p)]} and {i}: not supported")
                taken, holder = offloaded_by(p)
                if taken:
                    raise AlreadyOffloadedError(
                        f"parameter {full} is already offloaded (managed by another LayerwiseOffloadManager: "
                        f"{holder!r}); close its handle (handle.close() for mapoffload.offload, else the "
                        "manager's close()) first"
                    )
                if p.device.type == "meta":
                    raise ValueError(f"parameter {full} is on the meta device: load the checkpoint first")
                owner[id(p)] = i
                data = p.data
                nbytes, contiguous = describe(data)
                w = Weight([full], p, [(module, attr)], data.dtype, tuple(data.shape), tuple(data.stride()),
                           nbytes=nbytes, contiguous=contiguous)
                w.placeholder = OffloadedWeight(w.shape, w.stride, w.dtype, full, i, requires_grad=p.requires_grad,
                                                device=device)
                by_id[id(p)] = w
                store.weights.append(w)
        store.parts = _parts(store, base, prefix)
        stores.append(store)
    if unmanaged:
        logger.info(
            "%d weight(s) of the managed layers are shared with modules outside them (%s%s): left where the "
            "model keeps them, not offloaded",
            len(unmanaged), ", ".join(unmanaged[:3]), ", …" if len(unmanaged) > 3 else "",
        )
    return stores, unmanaged


def _outside_params(model: torch.nn.Module, layers: list[torch.nn.Module]) -> tuple[dict[int, torch.Tensor], dict[int, list]]:
    """CPU parameters of the modules outside ``layers`` that no manager offloads (by id), and the modules
    holding each."""
    from .placeholder import managed  # placeholders, and in place the real parameters another manager offloads

    holders: dict[int, list] = {}
    params: dict[int, torch.Tensor] = {}
    for m in modules_outside(model, layers):
        for p in m._parameters.values():
            if p is not None and p.device.type == "cpu" and not managed(p):
                holders.setdefault(id(p), []).append(m)
                params[id(p)] = p
    return params, holders


def _is_lookup(module: torch.nn.Module) -> bool:
    import torch

    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))


def _parts(store: LayerStore, base: str, prefix: dict[int, str]) -> list[Part]:
    """A layer's weights grouped by the submodule that holds each (its first holder), in module order."""
    parts: dict[int, Part] = {}
    for w in store.weights:
        module = w.holders[0][0]
        part = parts.get(id(module))
        if part is None:
            part = parts[id(module)] = Part(prefix.get(id(module), base), module)
        part.weights.append(w)
    return list(parts.values())


def always_read_tensors(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[tuple[torch.Tensor, int]]:
    """The mapped parameters outside the layers that every forward reads whole, with their bytes.

    A head, norms, a tied embedding used as the head: their pages are in use
    each forward and share the page cache with the layers. An embedding
    table held only by ``nn.Embedding`` modules is left out: a lookup reads
    a few rows of it, not the table (:func:`lookup_tables`).
    """
    params, holders = _outside_params(model, layers)
    read_whole = [p for k, p in params.items() if not all(_is_lookup(m) for m in holders[k])]
    if not read_whole:
        return []
    on_mapping = MappedRegions().classify([p.data for p in read_whole])
    return [(p.data, describe(p.data)[0]) for p, m in zip(read_whole, on_mapping) if m]


def lookup_tables(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The mapped parameters outside the layers that only ``nn.Embedding``/``EmbeddingBag`` modules hold.

    A forward reads a few rows of each (one per token), never the table: a
    fault's readahead there (the device's ``read_ahead_kb``, 8 MiB on some
    disks) reads megabytes per row, and under a tight cap, where the table is
    not kept cached, the whole table or more every forward. A tied table,
    also held by a head, is read whole and is not one.
    """
    params, holders = _outside_params(model, layers)
    tables = [p for k, p in params.items() if all(_is_lookup(m) for m in holders[k])]
    if not tables:
        return []
    on_mapping = MappedRegions().classify([p.data for p in tables])
    return [p.data for p, m in zip(tables, on_mapping) if m]


def _record(stores: list[LayerStore], decided: StorePlan) -> None:
    for s in stores:
        s.plan = decided


def _choose(weights: list[Weight], on_mapping: list[bool], host_store: str, available_bytes: int,
            local_ranks: int) -> StorePlan:
    """Each weight's store (mapped, strided or consolidated), by the rule ``host_store`` and the budget
    give; the decision, recorded."""
    mapped_candidates = {id(w) for w, m in zip(weights, on_mapping) if m and w.contiguous}
    candidate_bytes = sum(w.nbytes for w in weights if id(w) in mapped_candidates)
    if host_store == "auto":
        keep_mapped = host_copies_would_not_fit(
            candidate_bytes, available_bytes=available_bytes, local_ranks=local_ranks
        )
        rule = StoreRule.COPIES_DO_NOT_FIT if keep_mapped else StoreRule.COPIES_FIT
    else:
        keep_mapped, rule = host_store == "mapped", StoreRule.ASKED
    for w in weights:
        if keep_mapped and id(w) in mapped_candidates:
            w.store = MAPPED
            w.host = w.param.data
        elif not w.contiguous:
            w.store = STRIDED
        else:
            w.store = CONSOLIDATED
    return StorePlan(rule, host_store, candidate_bytes, available_bytes, local_ranks,
                     host_copy_room(available_bytes, local_ranks))


def _pin_choice(store: LayerStore, host_store: str, cuda: bool, budget: int) -> PinChoice:
    """Whether to pin the layer's consolidated buffers (``budget``: this rank's pinning room left)."""
    if not store.bytes_in(CONSOLIDATED):
        return PinChoice.NONE
    if host_store not in ("auto", "pinned"):
        return PinChoice.NOT_ASKED
    if not cuda:
        return PinChoice.NO_CUDA
    if host_store == "pinned" or store.bytes_in(CONSOLIDATED) <= budget:
        return PinChoice.PINNED
    return PinChoice.OVER_BUDGET


def plan(stores: list[LayerStore], host_store: str, available_bytes: int | None, *, cuda: bool,
         device: object, local_ranks: int = 1, in_place: bool = False) -> None:
    """Choose each weight's store, lay out each layer and build its host buffers; the decision is
    recorded on each store (``LayerStore.plan``, ``LayerStore.pin``).

    ``available_bytes`` is the host's headroom, shared by ``local_ranks``
    ranks that each make this plan: copies and pinned buffers are weighed
    against this rank's share of it.

    ``in_place`` (the CPU, computing from the host stores): with ``auto`` or
    ``mapped`` every weight stays as it is - on its mapping, or in the tensor
    the model already owns - and nothing is copied; ``pageable``/``pinned``
    copy into consolidated buffers as asked.
    """
    weights = [w for s in stores for w in s.weights]
    on_mapping = MappedRegions().classify([w.param.data for w in weights])
    if in_place and host_store in ("auto", "mapped"):
        for w, m in zip(weights, on_mapping):
            w.store = MAPPED if m else STRIDED
            w.host = w.param.data
        _record(stores, StorePlan(StoreRule.IN_PLACE, host_store, local_ranks=local_ranks))
        log_plan(stores, device)
        return
    if available_bytes is None:
        available_bytes = host_memory_available_bytes()
    _record(stores, _choose(weights, on_mapping, host_store, available_bytes, local_ranks))
    # Pinned stores are copied by DMA straight from pinned memory (no
    # staging), so each pinned byte buys overlap; pin while the budget lasts.
    budget = host_copy_room(available_bytes, local_ranks) // local_ranks  # this rank's share
    if host_store == "pinned" and not cuda:
        logger.info("host_store='pinned' on %s: pinning needs CUDA, using pageable buffers", device)
    bar = byte_bar(sum(s.bytes_in(CONSOLIDATED) + s.bytes_in(STRIDED) for s in stores), "Building host stores")
    for store in stores:
        bar.update(store.bytes_in(CONSOLIDATED) + store.bytes_in(STRIDED))
        layout(store)
        store.pin = _pin_choice(store, host_store, cuda, budget)
        pin = store.pin is PinChoice.PINNED
        if pin:
            budget -= store.bytes_in(CONSOLIDATED)
        build_consolidated(store, pin, device=device.index if cuda and device.index is not None else -1)
        if pin and not store.pinned:
            store.pin = PinChoice.REFUSED
        for w in store.weights:
            if w.store == STRIDED:
                build_strided(w)
    bar.close()
    log_plan(stores, device)
