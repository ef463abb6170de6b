"""Placeholders for released weights: shape-correct, and loud when computed with.

While a :class:`~mapoffload.LayerwiseOffloadManager` manages a layer on a
device (CUDA, or the CPU twin), each of its holders (``module._parameters[attr]``) holds either the
real parameter (its data on the device, while the layer is loaded) or an
:class:`OffloadedWeight`: a parameter on the
meta device, with the weight's shape, dtype and strides and no memory. Reading
its metadata works (``shape``, ``dtype``, ``numel()``…, and ``device``, which
answers the device the weight computes on, so code that inspects a model —
``model.device`` — keeps working); moving it between devices leaves it as it is (the
manager places it); anything that would read its values raises a
``RuntimeError`` naming the weight and its layer and saying how to load it —
never a silent result computed from zeros or garbage.

In place (``device="cpu"``) nothing moves and the holders keep the real
parameters (the host tensors) all the time; a placeholder only stands in for
its weight while a conversion (``model.to(...)``) runs, see
:func:`stand_in`.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

from . import hooks
from .hooks import CallNames, OffloadedCopyError, WeightNotLoadedError, copy_refusal

# Properties whose value would be computed from the data.
_DATA_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Device properties answer for the device the weight computes on.
_DEVICE_PROPERTIES = {
    "device": lambda d: d,
    "is_cuda": lambda d: d.type == "cuda",
    "is_cpu": lambda d: d.type == "cpu",
    "is_meta": lambda d: False,
}
# Methods that read metadata only.
_METADATA_METHODS = frozenset(
    {
        "size", "dim", "ndimension", "stride", "numel", "nelement", "element_size", "is_floating_point",
        "is_complex", "is_contiguous", "storage_offset", "is_pinned", "is_shared", "get_device",
        "_has_compatible_shallow_copy_type", "__hash__", "__format__", "requires_grad_",
    }
)
# Conversions a whole-model .to()/.cuda()/.cpu()/.half() applies: the manager
# owns where managed weights live, so a device move leaves the placeholder as
# it is; a dtype change cannot be honoured and is refused.
_MOVES = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "type"})
_DTYPE_OF = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


class OffloadedWeight(torch.nn.Parameter):
    """A released weight: metadata only (see the module docstring)."""

    _mo_name: str
    _mo_layer: int
    _mo_device: torch.device
    _mapoffload_manager: ManagerMark | None  # the manager's mark, as its real parameters carry it

    def __new__(cls, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, name: str, layer: int,
                requires_grad: bool = False, device: torch.device | str = "cpu") -> OffloadedWeight:
        data = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self._mo_name = name
        self._mo_layer = layer
        self._mo_device = torch.device(device)
        self._mapoffload_manager = None
        return self

    def renewed(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> OffloadedWeight:
        """A new placeholder for the same slot, of the weight's ``shape``, ``stride`` and ``dtype`` (its
        weight was replaced: this one stands for the old)."""
        fresh = OffloadedWeight(shape, stride, dtype, self._mo_name, self._mo_layer, device=self._mo_device)
        fresh._mapoffload_manager = self._mapoffload_manager
        return fresh

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return (
            f"OffloadedWeight({self._mo_name}, layer {self._mo_layer}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype})"
        )

    def __reduce_ex__(self, proto: Any) -> Any:
        raise OffloadedCopyError(copy_refusal(owner_of(self), "pickled", self))

    def __deepcopy__(self, memo: Any) -> Any:
        raise OffloadedCopyError(copy_refusal(owner_of(self), "copied (copy.deepcopy)", self))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        what = getattr(func, "__qualname__", name)
        if name in ("__get__", "__set__") and owner is not None:
            prop = getattr(owner, "__name__", "")
            what = f"read as .{prop}" if name == "__get__" else f"assigned .{prop}"
            if name == "__get__":
                if prop == "data":
                    return args[0]
                if prop in _DEVICE_PROPERTIES:
                    # Where the weight computes when loaded: `model.device`
                    # (the device of its first parameter) stays right.
                    return _DEVICE_PROPERTIES[prop](args[0]._mo_device)
                if prop == "requires_grad":  # what it stands for says (set on a real parameter while loaded)
                    stands = _stands_for(args[0])
                    if stands is not None:
                        return stands.requires_grad
                if prop not in _DATA_PROPERTIES:
                    return _plain(func, args, kwargs)
            elif prop == "data" and len(args) == 2 and args[1] is args[0]:
                return None  # Module._apply's `param.data = param` after a move
            elif prop == "data" and len(args) == 2 and isinstance(args[1], torch.Tensor):
                return _assign_data(args[0], args[1])
            elif prop == "requires_grad":
                out = _plain(func, args, kwargs)
                _follow_requires_grad(args[0])
                return out
        elif name == "get_device" and args and isinstance(args[0], OffloadedWeight):
            return args[0]._mo_device.index if args[0]._mo_device.type != "cpu" else -1
        elif name in _METADATA_METHODS:
            out = _plain(func, args, kwargs)
            if name == "requires_grad_" and args and isinstance(args[0], OffloadedWeight):
                _follow_requires_grad(args[0])
            return out
        elif name in _MOVES and args and isinstance(args[0], OffloadedWeight):
            return _move(args[0], name, args[1:], kwargs)
        elif name == "share_memory_" and args and isinstance(args[0], OffloadedWeight):
            raise OffloadedCopyError(share_refusal(owner_of(args[0]), args[0]._mo_name))
        else:
            what = f"used by {what}"
        raise WeightNotLoadedError(_message(_first(args, kwargs), what))


def _stands_for(w: OffloadedWeight) -> torch.nn.Parameter | None:
    """The real parameter ``w`` stands for: one a swap took out, else its weight's now; None once its manager
    is gone."""
    old = w.__dict__.get("_mo_stood_for")
    if old is not None:
        return old
    mgr = owner_of(w)
    weight = mgr.parts.by_name.get(w._mo_name) if mgr is not None and not mgr.parts.sequencer.closed else None
    return weight[1].param if weight is not None and weight[1].placeholder is w else None


def _take_up_swaps(w: OffloadedWeight) -> None:
    """A swap of ``w``'s weight not taken up yet (no forward since) is taken up now: ``w`` then stands for
    the parameter swapped out (``_mo_stood_for``), not for the weight the slot holds."""
    mgr = owner_of(w)
    if mgr is not None and not mgr.parts.sequencer.closed and mgr.parts.sequencer.engaged:
        mgr.parts.sequencer.adopt_edits(w._mo_layer, strict=False)  # a refused one is the next forward's error


def _follow_requires_grad(w: OffloadedWeight) -> None:
    """``requires_grad`` set on a placeholder (``model.requires_grad_(False)`` between forwards) is set on
    the real parameter it stands for too: the manager's gradient rule and the model given back see it.
    Refused for one whose manager closed (the model holds its real parameter again)."""
    mgr = owner_of(w)
    if mgr is None or mgr.parts.sequencer.closed:
        raise WeightNotLoadedError(_message(w, "set requires_grad"))
    with torch._C.DisableTorchFunctionSubclass():
        flag = w.requires_grad  # its own flag, just set (reading it asks what it stands for)
    _take_up_swaps(w)
    stands = _stands_for(w)
    if stands is not None and stands.requires_grad != flag:  # a swapped-out parameter's, or its weight's now
        stands.requires_grad_(flag)


def _assign_data(w: OffloadedWeight, value: torch.Tensor) -> None:
    """``placeholder.data = value`` between forwards: the values go into the weight's host store (its
    manager's ``update_cpu_weights``), so the next load computes with them; refused (naming the
    weight) where they cannot be the weight's."""
    from .hooks import ReplacedWeightError

    _take_up_swaps(w)
    old = getattr(w, "_mo_stood_for", None)
    if old is not None:  # the placeholder of a parameter swapped out: only that one changes, as in plain torch
        old.data = value
        return
    mgr = owner_of(w)
    if mgr is None:
        raise WeightNotLoadedError(_message(w, "assigned .data after its manager was gone"))
    if value.dtype != w.dtype or tuple(value.shape) != tuple(w.shape):
        raise ReplacedWeightError(
            f"{w._mo_name} (layer {w._mo_layer}) was assigned .data of {value.dtype} {tuple(value.shape)}, where the "
            f"offloaded weight is {w.dtype} {tuple(w.shape)}: an offloaded weight keeps its dtype and shape")
    mgr.update_cpu_weights({w._mo_name: value})


def _plain(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _move(self: OffloadedWeight, name: str, args: tuple, kwargs: dict) -> OffloadedWeight:
    dtype = _DTYPE_OF.get(name) or kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            dtype = a.dtype
    if name == "type" and not args and "dtype" not in kwargs:
        raise WeightNotLoadedError(_message(self, "asked for its type string"))
    if dtype is not None and dtype != self.dtype:
        raise OffloadedConversionError(_conversion_message(self, dtype))
    return self


def _first(args: tuple, kwargs: dict) -> OffloadedWeight | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, OffloadedWeight):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, OffloadedWeight):
                    return b
    return None


class OffloadedConversionError(RuntimeError, TypeError):
    """A dtype conversion (``model.to(torch.float16)``, ``.half()``) of an offloaded
    weight: refused before anything converts. A ``TypeError`` (the model cannot
    take that dtype while offloaded) and, as every placeholder refusal, a ``RuntimeError``."""


def _owner_words(w: OffloadedWeight) -> tuple[str | None, str | None]:
    """(the call that gives the model back, how to load it in another dtype) for ``w``'s owner."""
    mgr = owner_of(w)
    calls = mgr.calls if mgr is not None else CallNames()
    return calls.close, calls.reload


def _message(w: OffloadedWeight | None, what: str) -> str:
    if w is None:
        return f"an offloaded weight was {what}: its layer is not loaded"
    mgr = owner_of(w)
    if mgr is None or mgr.parts.sequencer.closed:
        return (f"{w._mo_name} was {what}, but this is the placeholder the model held while it was offloaded "
                f"(layer {w._mo_layer}), and its manager has closed: the model holds its real parameter again; "
                f"take that one from the model (its .{w._mo_name.rpartition('.')[2]}), not this placeholder")
    close, _ = _owner_words(w)
    # A forward hook registered after the manager's runs once the layer was released, and a forward pre-hook
    # registered before it runs before the layer is loaded: the weights are there only in between.
    hooks = ("A hook of yours on the layer sees them in a forward pre-hook registered after offloading, or "
             "a forward hook registered before it.")
    if close is not None:
        return (
            f"{w._mo_name} is offloaded and was {what} while its layer ({w._mo_layer}) is not loaded: its values "
            f"are read in only while that layer runs. Run the model (its hooks load each layer), or call {close} "
            f"first to get the real weights back. {hooks}"
        )
    return (
        f"{w._mo_name} is offloaded by a LayerwiseOffloadManager and was {what} while layer {w._mo_layer} "
        f"is not loaded. Run the model with the manager's hooks (register_forward_hooks()), load the layer "
        f"first (prefetch_layer({w._mo_layer}, non_blocking=False)), or close the manager (manager.close()) to "
        f"get the real weights back. {hooks}"
    )


def _conversion_message(w: OffloadedWeight, dtype: torch.dtype) -> str:
    close, reload = _owner_words(w)
    keeps = (f"an offloaded model keeps the dtype it was loaded in ({w.dtype}: its weights stay on their file "
             "mapping, and a conversion would copy them)")
    if close is None:
        return (f"{w._mo_name} is offloaded by a LayerwiseOffloadManager and was converted to {dtype}: {keeps}; "
                f"load the weights in {dtype}, or close the manager first (manager.close()) and convert the model")
    how = f"load it as {dtype} ({reload.format(dtype=dtype)})" if reload else "convert it before offloading it"
    return f"{w._mo_name} is offloaded and was converted to {dtype}: {keeps}; {how}, or call {close} first"


class ManagerMark:
    """What a managed parameter carries as ``_mapoffload_manager``: a weak reference to its manager,
    called for it. A parameter carrying one is not pickled (its manager is this process's): the
    refusal names the call that gives the model back, as the hooks' does."""

    __slots__ = ("ref",)

    def __init__(self, manager: object) -> None:
        self.ref = weakref.ref(manager)

    def __call__(self) -> object | None:
        return self.ref()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadedCopyError(copy_refusal(self.ref(), "pickled"))

    def __deepcopy__(self, memo: Any) -> Any:
        raise OffloadedCopyError(copy_refusal(self.ref(), "copied (copy.deepcopy)"))


class AlreadyOffloadedError(ValueError):
    """A model (or weight) handed to an offload is already offloaded by another manager."""


def owner_of(w: OffloadedWeight) -> object | None:
    """The manager whose placeholder ``w`` is, while it lives."""
    mark = w._mapoffload_manager
    return mark() if mark is not None else None


def offloaded_by(p: torch.Tensor) -> tuple[bool, object | None]:
    """Whether ``p`` is already offloaded, and by which manager (None: gone): the one definition.

    Released, a holder holds a placeholder (offloaded, its manager alive or not); loaded - or in place,
    always - it holds the real parameter, which its manager marks while it lives. The entry points and
    a manager's weight collection refuse such a parameter (:class:`AlreadyOffloadedError`).
    """
    if isinstance(p, OffloadedWeight):
        return True, owner_of(p)
    marker = getattr(p, "_mapoffload_manager", None)
    holder = marker() if marker is not None else None
    return holder is not None, holder


# --- refusing a whole-model conversion before it converts anything ---------------------
#
# ``model.to(torch.float32)`` converts modules children first: an embedding
# outside the managed layers is converted before the first placeholder
# refuses, which leaves the model half converted (and, after ``close()``, a
# forward that fails on mixed dtypes). While a manager is engaged, every module
# of its model answers ``_apply`` by first applying the conversion to each
# placeholder below it - a placeholder returns itself or raises, and converts
# nothing - so a refused conversion raises before any tensor changed.

#
# In place (``device="cpu"``) the holders hold the real parameters, the mapped
# tensors themselves, between forwards too. Each carries its placeholder as a
# stand-in (:func:`stand_in`): while a conversion runs, the stand-ins take the
# slots, so a dtype change is refused as above and a device move leaves the
# weights on their mapping; then the real parameters are put back.

_APPLY_STATE = threading.local()
_STAND_IN = "_mapoffload_stand_in"


def stand_in(param: torch.nn.Parameter, placeholder: OffloadedWeight | None) -> None:
    """``placeholder`` answers for the real ``param`` in conversions (None: no longer)."""
    if placeholder is None:
        param.__dict__.pop(_STAND_IN, None)
    else:
        param.__dict__[_STAND_IN] = placeholder


def _swap_in_stand_ins(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Any, Any]]:
    swapped = []
    for m in module.modules():
        for attr, p in m._parameters.items():
            s = None if p is None else p.__dict__.get(_STAND_IN)
            if s is not None:
                swapped.append((m, attr, p, s))
                m._parameters[attr] = s
    return swapped


def _guarded_apply(module: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
    outer = not getattr(_APPLY_STATE, "active", False)
    if not outer:
        return type(module)._apply(module, fn, *args, **kwargs)
    swapped = _swap_in_stand_ins(module)
    try:
        for p in module.parameters():
            if isinstance(p, OffloadedWeight):
                fn(p)  # raises for a conversion the placeholder refuses
        _APPLY_STATE.active = True
        try:
            return type(module)._apply(module, fn, *args, **kwargs)
        finally:
            _APPLY_STATE.active = False
    finally:
        for m, attr, p, s in swapped:
            if m._parameters.get(attr) is s:
                m._parameters[attr] = p


def guard_conversions(model: torch.nn.Module) -> None:
    """Make every module of ``model`` refuse a conversion its placeholders refuse, before converting.

    Counted (``hooks``, the patch registry): each call needs one :func:`unguard_conversions` (several managers
    share a model).
    """
    for m in model.modules():
        hooks.install(m, "_apply", functools.partial(_guarded_apply, m))
        hooks.install(m, "share_memory", functools.partial(_guarded_share_memory, m))


def unguard_conversions(model: torch.nn.Module) -> None:
    """Undo one :func:`guard_conversions`."""
    for m in model.modules():
        hooks.uninstall(m, "_apply")
        hooks.uninstall(m, "share_memory")


def share_refusal(manager: object | None, name: str | None) -> str:
    """The one message for ``share_memory()`` of an offloaded model, a layer or a weight."""
    close = (manager.calls.close if manager is not None else None) or "manager.close()"
    where = f" ({name} is one of its offloaded weights)" if name else ""
    return (f"share_memory() of an offloaded model{where} is refused: it would move each weight into a "
            "shared-memory copy of it. A weight on the checkpoint's file mapping is the file's private pages, "
            "which cannot become shared memory without that copy (and the offload keeps the weights where it "
            "placed them); processes that map the same checkpoint already share its page cache: load it mapped "
            f"in each. Call {close} first to share the plain model's weights (copied).")


def _guarded_share_memory(module: torch.nn.Module) -> torch.nn.Module:
    """``Module.share_memory()`` refused before anything moves when an offloaded weight is below
    ``module`` (the real parameters in place, or a loaded device layer's, would be copied into
    shared memory, the placeholders would raise half way); a module holding none is shared."""
    for p in module.parameters():
        held, manager = offloaded_by(p)
        if held:
            w = p if isinstance(p, OffloadedWeight) else p.__dict__.get(_STAND_IN)
            raise OffloadedCopyError(share_refusal(manager, getattr(w, "_mo_name", None)))
    return type(module).share_memory(module)


def managed(t: torch.Tensor) -> bool:
    """A weight some manager offloads (another stack of the same model): its manager checks it.

    Unlike :func:`offloaded_by`, a real parameter still marked by a manager that went away without
    ``close()`` counts: its holders may hold that manager's placeholders."""
    return isinstance(t, OffloadedWeight) or "_mapoffload_manager" in t.__dict__
