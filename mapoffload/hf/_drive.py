"""Driving transformers' (and diffusers') own ``from_pretrained`` with the mapping underneath.

transformers 5 loads safetensors as views of the file mapping and applies its
conversion mapping (renames, legacy names, experts fused into 3-D tensors,
split or merged projections), its dtype plan and its quantizers on the way.
mapoffload does not re-implement any of that: it lets transformers load, and
watches the one place where each final tensor is set into the model
(``core_model_loading.set_param_for_module``). A tensor set there that does
not live on a file mapping was *made* by a conversion; the tensors of one
conversion are written into the :class:`~mapoffload.conversion.ConversionCache` (a
bounded batch at a time) and the model gets their mapped views instead, so
anonymous memory never holds more than a batch.

On a later load whose cache is complete, the checkpoint keys the cached
tensors were made from are taken out of the state dict transformers reads and
the cached tensors put in under their final names: nothing is converted again.

diffusers' models load the same way through the one call that sets each
tensor (accelerate's ``set_module_tensor_to_device``): a tensor it set that is
not on a mapping was cast, and is written out and mapped the same way.

The hooks are installed for the duration of one load, under a lock; another
thread's plain transformers load in that window runs through them untouched
(the state is thread-local). This module holds what one load saw (the
:class:`Session`, fp8 weights kept as codes and scales) and installs the
hooks (:func:`driving`); the hooks themselves are transformers'
(:mod:`._drive_transformers`) and diffusers' (:mod:`._drive_diffusers`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from .._log import logger
from ..memory.regions import tensor_bytes
from ..conversion import PART_BYTES, ConversionCache

if TYPE_CHECKING:
    import torch

_LOCK = threading.RLock()
FP8_PART = ":"  # "<weight>:fp8_codes" / "<weight>:fp8_scale" in a conversion folder
# Made (and dropped) between two malloc_trim calls. Measured on a 24-layer fp8 Llama
# (transformers' dequantizing check of each kept weight): the load's anonymous peak
# was +141 MiB at 32 MiB, +103 at 16, +81 at 8, +53 trimming after every tensor;
# load time equal at 8 and 32 MiB, +13 % after every tensor.
TRIM_BYTES = 8 << 20
_STATE = threading.local()
_INSTALLED: list[tuple[Any, str, Any]] = []  # (owner, name, original) of the hooks now in place


def _after_fork_in_child() -> None:
    """A child forked while another thread loads inherits the lock held and the
    hooks installed by a thread that does not exist there: a fresh lock (else its
    own load waits forever) and transformers' functions back."""
    global _LOCK, _STATE
    for owner, name, original in reversed(_INSTALLED):
        setattr(owner, name, original)
    _INSTALLED.clear()
    _LOCK = threading.RLock()
    _STATE = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class _Set:
    """One tensor transformers set into the model."""

    name: str
    module: Any
    attr: str


@dataclass
class Session:
    """What one load saw: converted tensors, conversion errors, reuse."""

    cache: ConversionCache
    part_bytes: int = PART_BYTES
    regions: Any = None
    group: list[_Set] = field(default_factory=list)
    group_sources: set[str] = field(default_factory=set)
    pending: list[tuple[_Set, list[str]]] = field(default_factory=list)
    pending_bytes: int = 0
    conversion_errors: dict[str, str] = field(default_factory=dict)
    reusable: bool = True
    loads: int = 0
    keep_fp8: bool = False  # fp8 weights stay codes + scales (mapoffload.loading.fp8) where that is exact
    sources: Any = None  # the state dict transformers reads (checkpoint key -> slice or tensor)
    fp8_fused: Any = None  # (codes, scales) the last conversion's ops made of its fp8 inputs
    made_since_trim: int = 0
    files: list[str] | None = None  # the files the conversion is keyed on: transformers must read no other
    resolved: list[str] | None = None  # the files transformers resolved for this load
    stale: list[str] = field(default_factory=list)  # reused tensors the model took another dtype or shape for

    def snapshot(self) -> Any:
        """A :class:`~mapoffload.MappedRegions` in which views of the load's own files (the
        checkpoint's, the conversion's parts) count as mapped on any filesystem: a checkpoint on
        tmpfs is the file transformers read, not a tensor it made."""
        from ..memory.regions import MappedRegions

        return MappedRegions(files=[*(self.files or ()), *self.cache.part_files()])

    # -- per tensor ---------------------------------------------------------------

    def start_group(self, sources: set[str]) -> None:
        """A conversion is about to produce its outputs: close the previous one."""
        self.close_group()
        self.group_sources = set(sources)
        self.fp8_fused = None

    def record(self, name: str, module: Any, attr: str) -> None:
        self.group.append(_Set(name, module, attr))

    def close_group(self) -> None:
        """Spill the last conversion's outputs when any of them is not mapped
        (all of them then: a cached output replaces its sources, which its
        mapped siblings need too)."""
        group, sources = self.group, self.group_sources
        self.group, self.group_sources = [], set()
        tensors = [(s, _current(s)) for s in group]
        tensors = [(s, t) for s, t in tensors if t is not None and t.device.type == "cpu"]
        if not tensors or all(self.regions.holds(t) for _, t in tensors if t.numel()):
            return
        self._trim(sum(tensor_bytes(t) for _, t in tensors))
        if self.keep_fp8 and len(tensors) == 1 and self._keep_as_fp8(tensors[0][0], tensors[0][1], sources):
            return
        if not sources:
            self.reusable = False  # a conversion whose inputs we could not see: convert again next time
        for s, t in tensors:
            self.pending.append((s, sorted(sources)))
            self.pending_bytes += tensor_bytes(t)
        if self.pending_bytes >= self.part_bytes:
            self.flush()

    def _keep_as_fp8(self, target: _Set, value: torch.Tensor, sources: set[str]) -> bool:
        """A weight transformers dequantized from fp8: keep fp8 codes and block
        scales instead (one byte a parameter) when dequantizing them gives
        exactly what transformers made. One fp8 tensor and its scales: the
        checkpoint's own (mapped). Experts stacked from many: the same ops
        transformers ran, run on the codes and on the scales
        (:func:`._drive_transformers._fused_fp8`), written to the conversion folder and mapped.
        Anything else is converted as usual."""
        import torch

        from ..loading.fp8 import attach_fp8, dequantize_fp8, is_fp8

        codes = scale = None
        scales = [k for k in sources if k.endswith("_scale_inv")]
        fused = False
        if len(sources) == 2 and len(scales) == 1 and self.sources is not None:
            weight = scales[0][: -len("_scale_inv")]
            if weight in sources and weight in self.sources and scales[0] in self.sources:
                codes, scale = self.sources[weight][...], self.sources[scales[0]][...]
                if not self.regions.holds(codes):
                    codes = None
        if codes is None and self.fp8_fused is not None:
            (codes, scale), fused = self.fp8_fused, True
        if codes is None or not is_fp8(codes) or codes.shape != value.shape:
            return False
        try:
            if not torch.equal(dequantize_fp8(codes, scale, dtype=value.dtype), value):
                return False
        except (TypeError, ValueError):  # a scale this path cannot keep: transformers' value is converted
            return False
        attach_fp8(target.module, target.attr, codes, scale, dtype=value.dtype)
        plist = target.module.parametrizations[target.attr]
        plist.original._is_hf_initialized = True  # transformers must not initialise them again
        plist[0].scale._is_hf_initialized = True
        if fused:  # made here: written once, then mapped like any conversion
            for owner, attr, name in ((plist, "original", "fp8_codes"), (plist[0], "scale", "fp8_scale")):
                held = owner._parameters[attr]
                self.pending.append((_Set(f"{target.name}{FP8_PART}{name}", owner, attr), sorted(sources)))
                self.pending_bytes += tensor_bytes(held)
            if self.pending_bytes >= self.part_bytes:
                self.flush()
        return True

    def _trim(self, made: int) -> None:
        """Every :data:`TRIM_BYTES` of tensors made, hand what glibc retained of the
        freed temporaries back: it keeps them (a dozen MiB a weight, every size
        a little different), and a cgroup charges them like live memory — an fp8
        load under a tight cap was OOM-killed by memory nothing used."""
        self.made_since_trim += made
        if self.made_since_trim >= TRIM_BYTES:
            from ..memory.budget import release_freed_memory

            release_freed_memory()
            self.made_since_trim = 0

    def flush(self) -> None:
        """Write the pending converted tensors as one part and rebind their mapped views."""
        import torch

        if not self.pending:
            return
        tensors = {s.name: _current(s) for s, _ in self.pending}
        sources = {s.name: src for s, src in self.pending}
        views = self.cache.add(tensors, sources)
        for s, _ in self.pending:
            old = _current(s)
            view = views[s.name]
            if s.attr in s.module._buffers:
                view._is_hf_initialized = True  # as a parameter: else its init (BatchNorm's ones, zeros) overwrites it
                s.module._buffers[s.attr] = view
            else:
                p = torch.nn.Parameter(view, requires_grad=bool(old.requires_grad))
                p._is_hf_initialized = True  # transformers must not initialise it again
                s.module._parameters[s.attr] = p
        del tensors, views
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> None:
        self.close_group()
        self.flush()


def _current(s: _Set) -> torch.Tensor | None:
    t = s.module._buffers.get(s.attr) if s.attr in s.module._buffers else s.module._parameters.get(s.attr)
    return None if t is None else t.detach()


def _session() -> Session | None:
    return getattr(_STATE, "session", None)


@contextlib.contextmanager
def driving(cache: ConversionCache, hooks: list[tuple[Any, str, Any]], *,
            part_bytes: int | None = None, keep_fp8: bool = False,
            files: list[str] | None = None) -> Iterator[Session]:
    """``hooks`` (transformers': :func:`._drive_transformers.transformers_hooks`; diffusers':
    :func:`._drive_diffusers.diffusers_hooks`) installed for one load in this thread;
    yields its :class:`Session`.

    ``files`` are the checkpoint files ``cache`` is keyed on: a load that reads any other is
    refused before a weight is read (see :func:`._drive_transformers.check_resolved`).
    On success the cache is committed (when its conversions can be reused);
    on failure its unfinished files are dropped.
    """
    session = Session(cache, part_bytes=PART_BYTES if part_bytes is None else part_bytes, keep_fp8=keep_fp8,
                      files=files)
    with _LOCK:
        saved = []
        ok = False
        try:
            for owner, name, wrap in hooks:
                original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                saved.append((owner, name, original))
                _INSTALLED.append((owner, name, original))
                setattr(owner, name, wrap(original))
            _STATE.session = session
            yield session
            ok = True
        finally:
            _STATE.session = None
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)
            del _INSTALLED[len(_INSTALLED) - len(saved):]
            if session.loads:  # the temporaries of the conversions, back to the kernel
                from ..memory.budget import release_freed_memory

                release_freed_memory()
            if ok and session.reusable:
                cache.commit()
            else:
                if ok:
                    logger.info("a conversion's inputs were not visible: its files are not kept for reuse")
                cache.abandon()


def stale_tensors(model: Any, reused: dict[str, Any]) -> list[str]:
    """The reused conversion's tensors that the model took in another dtype or shape than they were stored:
    a conversion holds each tensor as the load set it into the model, so a difference means the model's
    code changed in a way the key did not see (a cast transformers then made of the stored values would
    round them through the old dtype, silently)."""
    out = []
    for name, tensor in reused.items():
        try:
            target = model.get_parameter(name)
        except AttributeError:
            try:
                target = model.get_buffer(name)
            except AttributeError:
                continue  # renamed by the model's own rules: not checkable by name
        if target.dtype != tensor.dtype or tuple(target.shape) != tuple(tensor.shape):
            out.append(f"{name}: stored {tensor.dtype} {tuple(tensor.shape)}, "
                       f"the model's {target.dtype} {tuple(target.shape)}")
    return out


def convert_again(cache: ConversionCache, session: Session, what: str) -> ConversionCache | None:
    """After a load that reused ``cache``: None when the model took every tensor as stored; else (the key
    missed a change of the model's code: a helper it calls, a value it reads) the conversion is discarded,
    with a warning naming the tensors, and the empty cache to load with again is returned."""
    if not session.stale:
        return None
    logger.warning("conversion %s does not hold what %s makes of the checkpoint now (%s): converting again",
                   cache.path, what, "; ".join(session.stale[:3]))
    cache.discard()
    return ConversionCache(cache.root, cache.key, origin=cache.origin)
