"""Host stores of the layerwise offload manager: which store each weight gets,
and where its bytes go on the host and on the device.

Each managed weight lives in one of three host stores:

``mapped``
    A view of the checkpoint's file mapping, kept as it is: never written,
    never copied on the host (page cache the kernel can drop and re-read).
``consolidated``
    One flat buffer per layer and dtype (pinned or pageable) holding only the
    layer's consolidated weights, back to back at aligned offsets: it stores
    nothing else and costs nothing more.
``strided``
    An owned tensor of its own with its exact layout: non-contiguous weights
    (sizes and strides kept; it moves as the byte extent its strides cover),
    and mapped weights replaced through ``update_cpu_weights``.

On the device every layer has one flat buffer per dtype: the consolidated
weights first, at the same offsets as in their host buffer, then every other
weight at an aligned offset. A prefetch moves each weight's own bytes and
nothing in between (adjacent spans merged): ``layer_bytes`` plus nothing.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._log import format_bytes, logger
from .._runs import merge_copies
from ..memory.regions import tensor_extent

if TYPE_CHECKING:
    import torch

ALIGN = 256  # bytes: device allocations and vector loads like this alignment

MAPPED, CONSOLIDATED, STRIDED = "mapped", "consolidated", "strided"


class StoreRule(str, enum.Enum):
    """Which rule chose the host stores of a manager's weights (:func:`~.plan.plan`)."""

    IN_PLACE = "in place"  # the CPU computes from the host tensors: each weight kept as it is
    ASKED = "asked"  # host_store named a store (mapped, pageable, pinned)
    COPIES_DO_NOT_FIT = "copies would not fit"  # auto: host copies would not fit, the mapped weights stay mapped
    COPIES_FIT = "copies fit"  # auto: host copies fit, the weights are copied into host buffers


class PinChoice(str, enum.Enum):
    """Why a layer's consolidated buffers are pinned or pageable."""

    NONE = "no consolidated weights"  # nothing to pin: mapped or strided weights only
    PINNED = "pinned"
    NOT_ASKED = "not asked"  # host_store='pageable', or 'mapped' (what is not on a mapping is copied pageable)
    NO_CUDA = "pinning needs CUDA"
    OVER_BUDGET = "over the pinning budget"  # auto: the rank's share of the room was spent on earlier layers
    REFUSED = "page-locking refused"  # the runtime refused cudaHostRegister: its copies are staged


@dataclass(frozen=True)
class StorePlan:
    """The decision :func:`~.plan.plan` made for a manager's weights, recorded on each layer's store
    (``summary()`` reads it rather than deriving it again)."""

    rule: StoreRule
    host_store: str  # as asked: auto, mapped, pageable, pinned
    weighed_bytes: int = 0  # the mapped bytes the auto rule weighed (contiguous weights on a file mapping)
    available_bytes: int | None = None  # the host's headroom it was weighed against (None: nothing weighed)
    local_ranks: int = 1
    room: int | None = None  # what the local ranks' copies may take together (``host_copy_room``)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class Weight:
    """One managed parameter (tied names share one entry)."""

    names: list[str]
    param: torch.nn.Parameter  # the model's own parameter object
    holders: list[tuple[Any, str]]  # (module, attribute) pairs that hold it
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int  # the byte extent its strides reach (numel * itemsize when contiguous)
    contiguous: bool
    store: str = CONSOLIDATED
    host: torch.Tensor | None = None  # mapped view, consolidated view or strided tensor
    host_offset: int = 0  # in the layer's consolidated buffer of its dtype
    dev_offset: int = 0  # in the layer's device buffer of its dtype
    placeholder: torch.nn.Parameter | None = None
    # What the holders were last given (the parameter or the placeholder) and the parameter's data then
    # (``Holders.bind``): anything else found there later is the user's edit (``Holders.edits``).
    held: Any = None
    bound: tuple | None = None
    version: int | None = None  # the parameter's version counter then: a write in place moves it


@dataclass
class Part:
    """One part of a layer: a submodule that holds weights itself (a projection, a norm), and those weights.

    Where the room does not hold a whole layer, a streamed layer is read in part by part as its parts
    run (``pagecache.residency.PART``); ``module`` is where a part's hooks go.
    """

    name: str
    module: Any
    weights: list[Weight] = field(default_factory=list)


@dataclass
class LayerStore:
    """Host side of one layer: its weights, buffers and prefetch spans."""

    index: int
    name: str
    weights: list[Weight] = field(default_factory=list)
    dev_bytes: dict = field(default_factory=dict)  # dtype -> device buffer size
    consolidated: dict = field(default_factory=dict)  # dtype -> uint8 host buffer
    pinned: bool = False
    plan: StorePlan | None = None  # the rule that chose its weights' stores (set by plan.plan)
    pin: PinChoice = PinChoice.NONE  # why its consolidated buffers are pinned or pageable
    parts: list[Part] = field(default_factory=list)  # its weights by the submodule that holds them, in module order
    _spans: list[tuple[Any, int, int, int, bool]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def bytes_in(self, store: str) -> int:
        return sum(w.nbytes for w in self.weights if w.store == store)

    def spans(self) -> list[tuple[Any, int, int, int, bool]]:
        """``(dtype, device offset, host address, nbytes, pinned source)`` of one prefetch.

        Built once (host addresses are stable until ``update_cpu_weights``
        replaces a tensor, which calls :meth:`invalidate`); spans that continue
        each other on both sides are merged.
        """
        if self._spans is None:
            merged = merge_copies(
                (w.dev_offset, w.host.data_ptr(), w.nbytes, (w.dtype, w.store == CONSOLIDATED and self.pinned))
                for w in sorted(self.weights, key=lambda w: (str(w.dtype), w.dev_offset))
            )
            self._spans = [(dtype, dst, src, n, pinned) for dst, src, n, (dtype, pinned) in merged]
        return self._spans

    def host_tensors(self) -> list[torch.Tensor]:
        """What a prefetch reads (held by the copier until the copy is done)."""
        return [w.host for w in self.weights]

    def invalidate(self) -> None:
        self._spans = None


def host_bytes(layers: list[LayerStore]) -> dict[str, int]:
    """Host bytes of the layers' weights by kind: ``mapped`` (kept on their file mapping), ``pinned``
    (consolidated, page-locked), ``pageable`` (consolidated pageable plus strided)."""
    out = {MAPPED: 0, "pinned": 0, "pageable": 0}
    for s in layers:
        for w in s.weights:
            if w.store == MAPPED:
                out[MAPPED] += w.nbytes
            elif w.store == CONSOLIDATED and s.pinned:
                out["pinned"] += w.nbytes
            elif w.store in (CONSOLIDATED, STRIDED):
                out["pageable"] += w.nbytes
    return out


def describe(t: torch.Tensor) -> tuple[int, bool]:
    """(byte extent, contiguous) of a tensor, by the package's one definition of its extent."""
    return tensor_extent(t)[1], t.is_contiguous()


def layout(layer: LayerStore) -> None:
    """Offsets: consolidated weights first (same offsets on host and device), then the rest."""
    cursor: dict = {}
    for w in layer.weights:
        if w.store == CONSOLIDATED:
            w.host_offset = w.dev_offset = align_up(cursor.get(w.dtype, 0))
            cursor[w.dtype] = w.dev_offset + w.nbytes
    host_end = dict(cursor)
    for w in layer.weights:
        if w.store != CONSOLIDATED:
            w.dev_offset = align_up(cursor.get(w.dtype, 0))
            cursor[w.dtype] = w.dev_offset + w.nbytes
    # Every dtype gets a buffer, an empty one for zero-size weights only:
    # their device views are views of it.
    layer.dev_bytes = {d: align_up(n) for d, n in cursor.items()}
    layer._host_end = host_end  # type: ignore[attr-defined]
    layer.invalidate()


_pin_refusals = 0  # registrations the runtime refused (the first is a warning, the rest debug)


def _unpin_quietly(pin: Any) -> None:
    try:
        pin.unregister()
    except Exception:  # a finalizer does not raise: the runtime refused (a sticky error, or exit)
        logger.debug("cudaHostUnregister of a pinned layer store failed", exc_info=True)


def _pin_exact(nbytes: int, device: int = -1) -> tuple[torch.Tensor, bool]:
    """A pageable buffer of exactly ``nbytes``, page-locked with cudaHostRegister; (buffer, pinned).

    torch's pinned caching allocator rounds sizes up to a power of two; for
    multi-GiB layer stores that doubles the pinned memory. Registered through
    the native loader (:class:`mapoffload._core.HostPin`: portable, ``device``
    current, a refusal cleared from the thread's last CUDA error - torch's
    ``cudart().cudaHostRegister`` leaves it there for torch's next launch
    check to raise). A refusal leaves the buffer pageable (its layer's copies
    are staged) rather than failing the manager. It is unregistered when the
    buffer object goes, before its memory can.
    """
    global _pin_refusals
    import torch

    from .._native import _core

    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not nbytes:
        return buf, True
    try:
        pin = _core.HostPin(buf.data_ptr(), nbytes, device=device)
    except _core.CudaError as e:
        _pin_refusals += 1
        log = logger.warning if _pin_refusals == 1 else logger.debug
        log("a layer store of %s could not be page-locked (%s): its copies are staged", format_bytes(nbytes), e)
        return buf, False
    weakref.finalize(buf, _unpin_quietly, pin)
    return buf, True


def build_consolidated(layer: LayerStore, pin: bool, *, device: int = -1) -> None:
    """Copy the layer's consolidated weights into one exact-size buffer per dtype.

    ``pin``: page-lock the buffers for CUDA ``device``; the layer is
    ``pinned`` when every one of them was."""
    import torch

    pinned = pin
    for dtype, end in layer._host_end.items():  # type: ignore[attr-defined]
        members = [w for w in layer.weights if w.store == CONSOLIDATED and w.dtype == dtype]
        if not members:
            continue
        if pin:
            buf, ok = _pin_exact(end, device)
            pinned = pinned and ok
        else:
            buf = torch.empty(end, dtype=torch.uint8)
        for w in members:
            view = buf[w.host_offset : w.host_offset + w.nbytes].view(dtype).view(w.shape)
            view.copy_(w.param.data)
            w.host = view
            # The parameter lets go of its old tensor now, layer by layer, so
            # building the stores never holds two copies of the whole model.
            w.param.data = view
        layer.consolidated[dtype] = buf
    layer.pinned = pinned and bool(layer.consolidated)
    layer.invalidate()


def build_strided(w: Weight) -> None:
    """Keep a non-contiguous weight's exact layout in an owned host tensor."""
    import torch

    src = w.param.data
    host = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype)
    host.copy_(src)
    w.host = host
    w.param.data = host


def device_view(w: Weight, buf: torch.Tensor) -> torch.Tensor:
    """The weight as a view of its layer's device buffer of its dtype."""
    flat = buf[w.dev_offset : w.dev_offset + w.nbytes].view(w.dtype)
    if w.contiguous:
        return flat.view(w.shape)
    return flat.as_strided(w.shape, w.stride)


def log_plan(layers: list[LayerStore], device: object) -> None:
    totals = {MAPPED: 0, "pinned": 0, "pageable": 0, STRIDED: 0}
    for layer in layers:
        totals[MAPPED] += layer.bytes_in(MAPPED)
        totals["pinned" if layer.pinned else "pageable"] += layer.bytes_in(CONSOLIDATED)
        totals[STRIDED] += layer.bytes_in(STRIDED)
    logger.info(
        "layerwise offload to %s, %d layers: %s mapped, %s pinned, %s pageable, %s strided",
        device, len(layers), *(format_bytes(totals[k]) for k in (MAPPED, "pinned", "pageable", STRIDED)),
    )
