"""The sequencer: which of a stack's layers are loaded and which are kept, and the user's edits to the
stack's weights. When a layer is loaded, and which are read ahead, is the runtime's step
(``runtime.py``).

It holds the stack's loads (each a :class:`~mapoffload.offload.loads.Load`, in flight or ready) and the
layers kept by ``load_all_layers``, and drives the load
path (``loads``: in place or device copies, each read through the mapping or uncached)
and what the model's holders of the weights hold. No hooks and no per-forward policy (``runtime.py``:
autograd, the reads policy, once-per-forward checks).

Host weights read and replaced (below the class): the manager's ``iter_cpu_weights`` (and
:func:`checksum` over them), ``sync_layer_to_cpu`` and ``update_cpu_weights``, and the user's own
replacements (:func:`adopt_edits`), which work on the sequencer's loads and holders and so live beside it.
A mapped weight is never written (a write would turn its pages anonymous): a sync skips it, an
update replaces it with an owned tensor and never writes to the file.

A weight the user replaces in the model between forwards (``layer.weight = nn.Parameter(new)``,
``layer.weight.data = new``, ``model.load_state_dict(sd, assign=True)``, or an in-place update of a
loaded layer's values) is the weight that computes from then on: the sequencer finds the edit
(:meth:`Sequencer.edits`) before it loads, releases or gives back the layer, and
:func:`adopt_edits` takes it - in place (``device="cpu"``) the new parameter itself becomes the weight
(an owned tensor, ``strided``), on the device path its values are written into the host store - or
refuses it with a :class:`ReplacedWeightError` naming the weight and what is wrong (another shape,
dtype or device, no values, a weight offloaded already).

The holders (each managed weight's ``module._parameters[attr]``): in place (``device="cpu"``) a holder
always holds the real parameter, its data the host tensor (the mapped view itself); a placeholder only
stands in for it while a conversion runs (:func:`~mapoffload.offload.placeholder.stand_in`). On the
device path a holder holds the real parameter with its device data while the layer is loaded, and the
shape-correct placeholder otherwise. Engaged, the holders follow the loads; disengaged
(``remove_forward_hooks``, ``close``), every holder holds the real parameter with its host data: the
model is whole. What the holders were last given is recorded on each weight (``held``, and ``bound``:
where the parameter's data was then), so that a user's edit between forwards is found.
"""


from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .._log import logger
from .hooks import ReplacedWeightError
from .stores import CONSOLIDATED, MAPPED, STRIDED, LayerStore, Weight

if TYPE_CHECKING:
    import torch

    from ..pagecache.layer_pages import LayerPages
    from .loads import Load, Target

__all__ = ["ReplacedWeightError", "Sequencer", "adopt_edits", "checksum", "data_key", "iter_cpu_weights",
           "sync_layer_to_cpu", "update_cpu_weights"]


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


class Sequencer:
    """Load, keep and release a stack's layers, and bind the model's holders of their weights to what
    they compute with.

    Parameters
    ----------
    stores
        One :class:`~mapoffload.offload.stores.LayerStore` per layer.
    loads
        The load path (``start``/``ready``/``value``/``release``/``drop_in_flight``).
    model
        The model (its conversions are guarded while the holders are engaged).
    in_place
        The layers compute from their host stores (``device="cpu"``): holders keep the real parameters.
    resident_layers
        The first N layers are never released by a step once loaded.
    pages, device
        The stack's pages and where its layers compute: what a weight the user replaced is adopted
        with (:meth:`adopt_edits`).
    """

    def __init__(self, stores: list[LayerStore], loads: Target, *, model: object, in_place: bool,
                 resident_layers: int, pages: LayerPages, device: torch.device) -> None:
        self.stores = stores
        self.loads = loads
        self.model = model
        self.in_place = in_place
        self.engaged = False  # the holders follow the loads
        self.closed = False  # never engaged again (the manager closed)
        self.pages = pages
        self.device = device
        self.resident_layers = resident_layers
        self.loaded: dict[int, Load] = {}  # layer -> its load, in flight or ready
        self.kept: set[int] = set()  # loaded by load_all: kept until released explicitly

    # -- the user's edits ------------------------------------------------------------------
    def adopt_edits(self, i: int, *, strict: bool = True) -> None:
        """Weights of layer ``i`` the user replaced since they were bound become the weights that compute,
        or are refused (:func:`~mapoffload.offload.sequencer.adopt_edits`): run before anything reads
        the layer's host stores or binds over its holders."""
        edits = self.edits(self.stores[i])
        load = self.loaded.get(i)
        if edits and load is not None and not load.ready:
            if strict:
                self.ensure(i)  # in flight: it lands, is let go (the edit adopted then) and is loaded afresh
                return
            try:  # the model given back (close never raises): it lands, and is let go with the edit as it is
                self.loads.ready(i, load)
            finally:
                self.release(i, strict=False)
            return
        if edits:
            adopt_edits(self, self.pages, self.stores[i], edits, device=self.device, strict=strict)

    def adopt_all(self, *, strict: bool = True) -> None:
        """:meth:`adopt_edits` for every layer (before the stores are read: a query, the model given back);
        nothing once closed (the model is the user's)."""
        if self.closed:
            return
        for i in range(len(self.stores)):
            self.adopt_edits(i, strict=strict)

    def engage(self) -> None:
        """Engage the holders, adopting first what the user replaced while the model was whole: bind every
        holder as released (placeholders on the device path) and guard the model's conversions.

        Idempotent; raises once closed.
        """
        if self.closed:
            raise RuntimeError("this LayerwiseOffloadManager is closed")
        if self.engaged:
            return
        self.adopt_all()
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

        # A slot the user pointed at another weight's placeholder (a tie made on the device path, refused
        # while offloaded) gets that weight's real parameter: the tie they made, not a placeholder.
        real = {id(w.placeholder): w for s in self.stores for w in s.weights}
        for s in self.stores:
            for w in s.weights:
                if data_key(w.param) == w.bound:  # else new .data the user gave it, refused: it stays theirs
                    w.param.data = w.host
                stand_in(w.param, None)
                for module, attr in w.holders:
                    if module._parameters.get(attr) is w.held:  # a refused edit stays the user's
                        module._parameters[attr] = w.param
                self.note(w, w.param)
        for module in self.model.modules():  # any slot, this stack's or another's
            for attr, held in list(module._parameters.items()):
                if held is not None and id(held) in real:
                    module._parameters[attr] = real[id(held)].param
                elif getattr(held, "_mo_stood_for", None) is not None:  # one a swap left: its old parameter
                    module._parameters[attr] = held._mo_stood_for

        unguard_conversions(self.model)
        self.engaged = False

    # -- the holders -----------------------------------------------------------------------
    def bind(self, w: Weight, data: torch.Tensor | None) -> None:
        """Its holders hold the real parameter with ``data``, or (None) with its host data in place, the placeholder
        on the device path."""
        if data is None:
            w.param.data = w.host  # never left pointing into a recycled device buffer
            target = w.param if self.in_place else w.placeholder
            if target is not w.param and target.requires_grad != w.param.requires_grad:  # set while it was loaded
                import torch

                with torch._C.DisableTorchFunctionSubclass():  # the flag only (not the placeholder's own rule)
                    target.requires_grad_(w.param.requires_grad)
        else:
            w.param.data = data
            target = w.param
        for module, attr in w.holders:
            if not lent(module._parameters.get(attr)):  # a tensor the user lent the model computes as it is
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
            if any(p is not w.held for p in now) and not all(p is w.held or lent(p) for p in now):
                out.append((w, now))  # replaced (a tensor lent for a call, in every holder, is no edit: lent())
            elif data_key(w.param) != w.bound or (_version(w.param) != w.version and (
                    not self.in_place or not self.on_host(w))):
                # A write into the parameter (load_state_dict without assign, an in-place op under no_grad)
                # lands in a buffer the next release recycles (a device buffer; in place, one read uncached):
                # it is taken like a replacement. Bound to its host store in place, the write is the weight.
                out.append((w, [w.param] * len(now)))
        return out

    @staticmethod
    def on_host(w: Weight) -> bool:
        """Whether ``w``'s parameter computes from its host store (not from a load's buffer)."""
        return w.host is not None and w.bound == data_key(w.host)

    # -- one layer -------------------------------------------------------------------------
    def prefetch(self, i: int) -> None:
        """Start loading layer ``i`` (no-op when loaded or in flight); engages the holders."""
        self.engage()
        if i not in self.loaded:
            self.adopt_edits(i)
            self.loaded[i] = self.loads.start(i)

    def ensure(self, i: int) -> None:
        """Layer ``i`` loaded and its weights bound (started here when it was not)."""
        if i not in self.loaded:
            self.prefetch(i)
        load = self.loaded[i]
        if load.ready:
            self.adopt_edits(i)  # a layer kept loaded (resident, load_all) can be edited between forwards
            return
        try:
            self.loads.ready(i, load)
        except BaseException:
            # The layer is released (its buffers back once the failed load
            # stopped): the next attempt starts afresh, e.g. after the file
            # behind a mapping is whole again.
            self.release(i)
            raise
        if self.edits(self.stores[i]):
            # Replaced while it loaded (a prefetch, another layer's hook): what it read is the old
            # weight's. The edit is adopted as the layer is let go, and the layer loaded afresh.
            self.release(i)
            self.ensure(i)
            return
        for w in self.stores[i].weights:
            value = self.loads.value(w, load)
            if self.in_place and value is not w.host and _version(w.param) != w.version:
                value = w.host  # written in its host store while its file bytes were read uncached: the host is right
            self.bind(w, value)
        load.ready = True
        load.handle = None

    def release(self, i: int, *, strict: bool = True) -> None:
        """Drop layer ``i``'s load (its holders bound as released) and un-keep it."""
        self.kept.discard(i)
        load = self.loaded.pop(i, None)
        if load is None:
            return
        try:
            if self.engaged:  # not loaded now: an edit is written into the host store, not the load
                self.adopt_edits(i, strict=strict)
        finally:
            if self.engaged:
                refused = {id(w) for w, _ in self.edits(self.stores[i])}  # left as the user made them
                for w in self.stores[i].weights:
                    if id(w) not in refused:
                        self.bind(w, None)
            self.loads.release(i, load)

    def is_loaded(self, i: int) -> bool:
        """Layer ``i`` is loaded and bound (not merely in flight)."""
        return i in self.loaded and self.loaded[i].ready

    def releasable(self, i: int) -> bool:
        """Whether a step may release layer ``i`` (not resident, not kept)."""
        return i >= self.resident_layers and i not in self.kept

    # -- every layer -----------------------------------------------------------------------
    def release_all(self, *, strict: bool = True) -> None:
        for i in list(self.loaded):
            self.release(i, strict=strict)

    def load_all(self) -> None:
        """Load every layer and keep it until released explicitly."""
        n = len(self.stores)
        for i in range(n):
            self.prefetch(i)
        for i in range(n):
            self.ensure(i)
        self.kept.update(range(n))

    def forget_in_flight(self) -> None:
        """In a forked child: drop the loads that were in flight at the fork (nothing completes them here)."""
        for i, load in list(self.loaded.items()):
            if not load.ready:
                del self.loaded[i]
                self.kept.discard(i)
                self.loads.drop_in_flight(load)


# -- host weights read and replaced ------------------------------------------------------
def iter_cpu_weights(stores: list[LayerStore]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, host tensor)`` for every weight of ``stores``, mapped ones included."""
    for s in stores:
        for w in s.weights:
            for n in w.names:
                yield n, w.host


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names and host bytes: the same whether a weight is mapped or copied."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sync_layer_to_cpu(seq: Sequencer, i: int) -> None:
    """Write layer ``i``'s device weights back to its host stores (``seq``: the stack's sequencer).

    Mapped weights are never written (a write would turn their pages
    anonymous); consolidated and strided stores are updated.
    """
    if i not in seq.loaded or not seq.loads.copies:
        return  # nothing on the device to write back (in place: the host store is what computes)
    seq.ensure(i)
    loaded = seq.loaded[i]
    for w in seq.stores[i].weights:
        seq.loads.write_back(w, loaded)


def update_cpu_weights(named_tensors: Mapping[str, torch.Tensor] | Iterator, *, seq: Sequencer,
                       pages: LayerPages, weight: Callable[[str], tuple[LayerStore, Weight]],
                       device: torch.device) -> None:
    """Replace host weights; a mapped entry becomes an owned tensor.

    ``seq`` is the stack's sequencer (its loads and holders), ``pages`` its pages, ``weight(name)`` the
    managed weight of a name (``KeyError`` otherwise), ``device`` where the layers compute.

    The checkpoint file is never written. A loaded layer's device copy is
    updated as well. A value of another dtype is converted when that loses
    no kind of information (``torch.can_cast``: float64 into float32 is
    fine, complex into real or float into int is not).

    Raises
    ------
    KeyError
        The name is not a managed weight.
    ValueError
        The shape differs, or the value is on the meta device (no data).
    TypeError
        The value is not a tensor, or its dtype cannot be cast to the weight's.
    """
    import torch

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    settled = False  # the device has finished every copy queued so far
    for name, value in items:
        store, w = weight(name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: the new value is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != w.shape:
            raise ValueError(f"{name}: new shape {tuple(value.shape)} does not match {w.shape}")
        if value.device.type == "meta":
            raise ValueError(f"{name}: the new value is on the meta device (it has no data)")
        if not torch.can_cast(value.dtype, w.dtype):
            raise TypeError(
                f"{name}: a {value.dtype} value cannot be stored in a {w.dtype} weight without losing data"
            )
        seq.adopt_edits(store.index)  # a holder the user filled before: this update comes after it
        settled = _write(seq, pages, store, w, value.detach().to(device="cpu", dtype=w.dtype), device=device,
                         settled=settled)


def _write(seq: Sequencer, pages: LayerPages, store: LayerStore, w: Weight, value: torch.Tensor, *,
           device: torch.device, settled: bool) -> bool:
    """Write ``value`` (on the CPU, ``w``'s dtype and shape) into ``w``'s host store, its device copy
    if loaded, and bind it; returns ``settled`` (the device finished every copy queued so far)."""
    import torch

    loaded = seq.loaded.get(store.index)
    if loaded is not None and not loaded.ready:
        # A prefetch in flight reads the host store: let it finish (and
        # bind), so that the write below is not torn into it and the
        # device copy is updated too. A failed one is released: the
        # next load reads the new weights.
        try:
            seq.ensure(store.index)
        except Exception:
            logger.debug("prefetch of layer %d failed before an update", store.index, exc_info=True)
    if w.store == MAPPED:
        # An owned tensor of its own (the strided store's kind), same
        # layout and extent: the mapping is left as it is.
        with torch.inference_mode(False):
            w.host = torch.empty_strided(w.shape, w.stride, dtype=w.dtype)
        w.host.copy_(value)
        w.store = STRIDED
        store.invalidate()
        pages.forget(store.index)
        seq.loads.forget(store.index)
    else:
        if device.type == "cuda" and store.pinned and w.store == CONSOLIDATED and not settled:
            # A pinned store is copied by DMA straight from it, when the
            # device reaches the copy - not when it was queued: a copy
            # still pending (a released layer, a forward the host has
            # run ahead of) would read this write into a forward queued
            # before the update. Staged and strided sources were read
            # into the staging slots before their copies were queued.
            torch.cuda.synchronize(device)
            settled = True
        w.host.copy_(value)
    if seq.is_loaded(store.index):
        if seq.loads.copies:
            seq.loads.value(w, seq.loaded[store.index]).copy_(value)
        else:
            seq.bind(w, w.host)
    elif seq.in_place or not seq.engaged:
        w.param.data = w.host
    if w.held is not None:
        seq.note(w, w.held)  # the data the library bound is no user's edit
    return settled


def adopt_edits(seq: Sequencer, pages: LayerPages, store: LayerStore, edits: list[tuple[Weight, list]], *,
                device: torch.device, strict: bool = True) -> None:
    """Make the user's replacements of ``store``'s weights (``Holders.edits``) the weights that compute.

    In place the new parameter itself becomes the weight (its data an owned, ``strided`` host tensor:
    nothing is copied, and the model stays a normal model holding the user's parameter); on the device
    path its values are written into the weight's host store (a mapped weight becomes an owned tensor,
    the file is never written) and the user's parameter is the one bound while the layer is loaded.

    Raises
    ------
    ReplacedWeightError
        With ``strict``, for an edit that cannot be taken (see :func:`refusal`); without it (the model
        being given back) the edit is logged and left as the user made it.
    """
    for w, now in edits:
        restored = now[0] if len({id(p) for p in now}) == 1 else None
        restored = restored if getattr(restored, "_mo_stood_for", None) is not None else None
        if restored is not None:  # a placeholder a weight had before a replacement: the parameter it stood for
            now = [restored._mo_stood_for] * len(now)
            restored = restored if restored._mo_name in w.names else None  # this weight's own, put back
        if all(p is w.param or p is w.placeholder for p in now) and data_key(w.param) == w.bound \
                and _version(w.param) == w.version:
            # The weight's own parameter or placeholder put back, unchanged (on the device path the slot held
            # the other while the layer was loaded or released): bound again, nothing written.
            load = seq.loaded.get(store.index)
            seq.bind(w, seq.loads.value(w, load) if load is not None and seq.is_loaded(store.index) else None)
            continue
        why = refusal(w, now, in_place=seq.in_place) or _shared(seq, w, now[0])
        if why is not None and now[0] is None and _parametrized(w):
            why = ("it was moved into a parametrization (torch.nn.utils.parametrize, weight_norm): an offloaded "
                   "layer's weights are not reparametrized; apply it before offloading, or close the manager first")
        if why is not None:
            msg = f"{w.names[0]} (layer {store.index}) was replaced in the offloaded model, but {why}"
            if strict:
                raise ReplacedWeightError(msg)
            logger.warning("%s; the model is given back with it as it is", msg)
            continue
        _adopt(seq, pages, store, w, now[0], device=device)
        if restored is not None:  # the holders hold that placeholder again, as the one who put it back expects
            w.placeholder, restored._mo_stood_for = restored, None
            if not seq.is_loaded(store.index) and seq.engaged:
                seq.bind(w, None)
        logger.info("%s: the weight replaced in the model computes from now on (%s)", w.names[0],
                    "in place, an owned tensor" if seq.in_place else "written into its host store")


def _parametrized(w: Weight) -> bool:
    """Whether a holder of ``w`` moved it into a parametrization (its slot emptied, not by the user)."""
    from torch.nn.utils import parametrize

    return any(parametrize.is_parametrized(module, attr) for module, attr in w.holders)


def lent(held: Any) -> bool:
    """Whether a module's parameter slot holds a plain tensor (not an ``nn.Parameter``) the user put there:
    ``torch.func.functional_call`` does, for one call, and puts the parameter back after it. It computes as
    it is, as in plain PyTorch (autograd reaches it), and the weight is left as it was: taking it as the
    weight wrote it into the weight's own parameter (in place) or host store (the device path), which the
    model kept computing with once the parameter was put back."""
    import torch

    return isinstance(held, torch.Tensor) and not isinstance(held, torch.nn.Parameter)


def refusal(w: Weight, now: list, *, in_place: bool) -> str | None:
    """Why the tensors now in ``w``'s holders (``now``) cannot become the weight, or None."""
    import torch

    from .placeholder import OffloadedWeight, offloaded_by

    names = ", ".join(w.names)
    if len({id(p) for p in now}) > 1:
        return (f"only in some of the places that share it ({names}): replace it in every one (or tie them "
                "before offloading)")
    new = now[0]
    if new is None:
        return "it was removed (None): an offloaded layer keeps each of its weights; close the manager first"
    if not isinstance(new, torch.Tensor):
        return f"with a {type(new).__name__}, not a tensor"
    owner = offloaded_by(new)[1] if isinstance(new, OffloadedWeight) else None
    if isinstance(new, OffloadedWeight) and (owner is None or owner.parts.sequencer.closed):
        return ("with a placeholder from an offloaded model's manager that has closed (what the model held while "
                "it was offloaded before), which has no values: assign the model's real parameter")
    if isinstance(new, OffloadedWeight) and getattr(new, "_mo_name", None) not in w.names:
        return (f"with {getattr(new, '_mo_name', 'another weight')}'s placeholder (what the model holds between "
                "forwards on the device path), which has no values: tie the weights before offloading, or close "
                "the manager first (it gives the model back with the weights tied as you made them)")
    if isinstance(new, OffloadedWeight):
        return ("with an offloaded placeholder (what the model holds between forwards on the device path: this "
                "one stood for this weight before a replacement no longer held), which has no values: assign a "
                "tensor that has them")
    if new is not w.param and offloaded_by(new)[0]:
        return ("with a weight mapoffload offloads already (another layer's): assign a copy of it (.clone()), "
                "or tie the weights before offloading")
    if new.is_meta:
        return "with a tensor on the meta device, which has no values"
    if new.layout != torch.strided:
        return f"with a {new.layout} tensor: offloaded weights are dense (strided) tensors"
    if tuple(new.shape) != w.shape:
        return f"with shape {tuple(new.shape)}, where the offloaded weight has {w.shape}"
    if new.dtype != w.dtype:
        return (f"with a {new.dtype} tensor, where the offloaded weight is {w.dtype}: an offloaded model keeps "
                f"the dtype it was loaded in; assign new.to({w.dtype}), or close the manager first")
    if in_place and new.device.type != "cpu":
        return (f"with a tensor on {new.device}, where this manager computes on the CPU in place: assign a CPU "
                "tensor")
    return None


def _shared(seq: Sequencer, w: Weight, new: torch.Tensor) -> str | None:
    """In place, why ``new`` cannot be ``w``'s own tensor: its bytes are another managed weight's (a view
    of it: a later ``update_cpu_weights`` of one would write into the other), or None. On the device
    path the values are copied into ``w``'s store, so sharing is harmless there."""
    from ..memory.regions import tensor_extent, tensor_spans

    if not seq.in_place or new.device.type != "cpu":
        return None
    addr, n = tensor_extent(new)
    others = [o for s in seq.stores for o in s.weights if o is not w and o.host is not None]
    spans = tensor_spans([o.host for o in others])
    for o, a, m in zip(others, spans.addrs, spans.sizes):
        if n and m and a < addr + n and addr < a + m:
            return (f"with a tensor that shares its bytes with {o.names[0]}, another offloaded weight: assign a "
                    "copy of it (.clone())")
    return None


def _adopt(seq: Sequencer, pages: LayerPages, store: LayerStore, w: Weight, new: torch.Tensor, *,
           device: torch.device) -> None:
    """Take ``new`` (checked by :func:`refusal`) as ``w``: see :func:`adopt_edits`."""
    import torch

    from ..memory.regions import tensor_extent
    from .placeholder import stand_in

    if new.is_inference():
        # Made under torch.inference_mode: such a tensor takes no other data and is not written outside
        # it (a later update, the device path's rebinding). Its values become the weight; the parameter
        # stays the manager's.
        with torch.inference_mode(False):
            new = new.detach().clone()
    if isinstance(new, torch.nn.Parameter) and new is not w.param:
        # The user's parameter is the weight's from now on (an optimizer or a caller holding it sees the
        # weight that computes); the old one is let go of, its marks with it.
        old = w.param
        mark = old.__dict__.pop("_mapoffload_manager", None)
        stand_in(old, None)
        if mark is not None:
            new._mapoffload_manager = mark
        w.param = new
        if not seq.in_place:
            # The old parameter keeps its values (its data was the host store or a device buffer, which the
            # new values are written into, or which the next loads reuse: a mapping view stays right), and
            # the placeholder the holders held between forwards stands for it: either put back (a user's
            # swap undone, torch.func.functional_call restoring what it found) is taken as that weight again.
            if data_key(old) == w.bound:  # still what the manager bound (else the user gave it data since)
                current = old.data if seq.is_loaded(store.index) else w.host  # released: what an update wrote
                old.data = current if w.store == MAPPED and current is w.host else current.detach().clone()
            previous, w.placeholder = w.placeholder, w.placeholder.renewed(w.shape, w.stride, w.dtype)
            previous._mo_stood_for = old
        with torch._C.DisableTorchFunctionSubclass():  # the flag only: not the placeholder's rule for users
            w.placeholder.requires_grad_(new.requires_grad)
    elif not isinstance(new, torch.nn.Parameter):  # a plain tensor put into module._parameters
        w.param.data = new.detach()
    if seq.in_place:
        value = w.param.data
        if new is w.param and not seq.on_host(w) and data_key(value) == w.bound:
            # Written in place while bound to a load's buffer (read uncached), which the next loads reuse:
            # the values the user made are taken out of it.
            value = w.param.data = value.clone()
        w.host, w.store = value, STRIDED  # owned by the model now (possibly the user's view of a mapping)
        w.stride, w.contiguous, w.nbytes = tuple(value.stride()), value.is_contiguous(), tensor_extent(value)[1]
        if seq.engaged:
            stand_in(w.param, w.placeholder)
        store.invalidate()
        pages.forget(store.index)
        seq.loads.forget(store.index)
        seq.bind(w, w.host if seq.is_loaded(store.index) else None)
        return
    value = w.param.data.detach().to(device="cpu")
    w.param.data = w.host  # what the holders bind next (never the user's CPU tensor besides the store)
    seq.note(w, w.held)
    _write(seq, pages, store, w, value, device=device, settled=False)
    if seq.is_loaded(store.index):
        seq.bind(w, seq.loads.value(w, seq.loaded[store.index]))
    elif seq.engaged:
        seq.bind(w, None)
