"""FP8 weights kept at one byte a parameter, dequantized as they are used.

Fine-grained FP8 checkpoints (DeepSeek-V3/R1, the Qwen3 ``-FP8`` releases)
store each projection as ``float8_e4m3fn`` codes with a ``weight_scale_inv``
per block (``[128, 128]`` tiles; per-tensor and per-channel scales are the
same rule with one block or one column of blocks). :func:`attach_fp8` keeps
the codes and the scales as the module's parameters — on the file mapping
when they come from it, streamed by a :class:`~mapoffload.LayerwiseOffloadManager`
at one byte a parameter — and makes ``module.weight`` a parametrization
(``torch.nn.utils.parametrize``) that dequantizes on use (once per forward of
the module: a weight read again, as an MoE's experts are, is reused), on the
device the codes are on (the compute stream on CUDA), with transformers'
arithmetic (``Fp8Dequantize``): ``(codes.float() * scale).to(dtype)`` over the
block grid the scales define. The dequantized weight lives only while the
module computes (one weight at a time, never the model).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.nn.utils import parametrize

from .fp8_workspace import workspace

__all__ = ["FP8_DTYPES", "Fp8Dequantize", "attach_fp8", "dequantize_fp8", "fp8_weights", "is_fp8", "quantize_fp8"]

# Rows of the block grid dequantized per step: bounds the float32 temporaries
# (transformers' formula promotes to float32) to a slice of the weight.
_CHUNK_ELEMENTS = 1 << 22


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def is_fp8(t: torch.Tensor) -> bool:
    """A tensor of a float8 dtype."""
    return t.dtype in FP8_DTYPES


def _grid(codes: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int, int]:
    """(scale rows, block rows, scale cols, block cols), as transformers derives them:
    the block is the weight's shape over the scale grid's.

    Every dimension is checked (``ValueError`` naming both shapes): a scale of
    one element (one block), or a grid ``[..., rows/bm, cols/bn]`` whose
    leading dimensions are the codes' own (one grid per expert) or all 1 (one
    grid for every expert). transformers' formula refuses the rest; without
    the check a grid per expert short of the experts reused its last one."""
    rows, cols = codes.shape[-2:]
    if scale.dim() < 2:
        if scale.numel() != 1:
            raise ValueError(f"scale grid {tuple(scale.shape)} does not fit weight {tuple(codes.shape)}: a scale "
                             f"of fewer than 2 dimensions must be one element")
        return 1, rows, 1, cols
    srows, scols = scale.shape[-2:]
    if srows == 0 or scols == 0 or rows % srows or cols % scols:
        raise ValueError(f"weight shape ({rows}, {cols}) is not divisible by its scale grid ({srows}, {scols})")
    lead, slead = tuple(codes.shape[:-2]), tuple(scale.shape[:-2])
    if slead != lead and any(d != 1 for d in slead):
        raise ValueError(f"scale grid {tuple(scale.shape)} does not fit weight {tuple(codes.shape)}: its leading "
                         f"dimensions {slead} must be the weight's {lead} (a grid each) or all 1 (one grid)")
    return srows, rows // srows, scols, cols // scols


# Scale dtypes and how transformers turns them into float32 multipliers
# (integrations/finegrained_fp8.py, Fp8Dequantize._dequantize_one): floating
# point (float32, bfloat16, float16, float8_e8m0fnu) by conversion; uint8 as
# E8M0 exponents (MXFP8 checkpoints), 2 ** (byte - 127). Nothing else.
def scale_as_float32(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as the float32 multipliers transformers computes from it,
    with the same ops (so the same bits): ``uint8`` is read as E8M0 exponents
    (``2 ** (byte - 127)``), a floating dtype is converted. Other dtypes raise
    ``TypeError`` naming the dtype."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    if scale.dtype.is_floating_point:
        return scale.to(torch.float32)
    raise TypeError(f"a scale of dtype {str(scale.dtype).removeprefix('torch.')} is not one transformers decodes: "
                    f"float32, bfloat16, float16, float8_e8m0fnu, or uint8 (E8M0 exponents)")


def check_fp8_pair(codes: torch.Tensor, scale: torch.Tensor) -> None:
    """The checks a (codes, scale) pair passes before it is kept: a scale dtype
    transformers decodes (``TypeError``) and a grid that fits (``ValueError``)."""
    if not scale.dtype.is_floating_point and scale.dtype != torch.uint8:
        scale_as_float32(scale)  # raises, naming the dtype
    _grid(codes, scale)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``codes`` (float8, ``[..., rows, cols]``) times their per-block ``scale``
    (``weight_scale_inv``: ``[..., rows/bm, cols/bn]``, a scalar for one block),
    in ``dtype``; bit for bit what transformers' ``Fp8Dequantize`` computes.

    CPU tensors, contiguous, into bfloat16, float16 or float32: one pass of
    the native kernel (``_core.dequantize_fp8``: a float32 multiply per
    element, rounded as torch rounds, on ``torch.get_num_threads()`` threads
    — ``MAPOFFLOAD_FP8_THREADS`` overrides — with the GIL released). Anything else (CUDA, strided, other dtypes):
    torch's ops, a band of block rows at a time into ``out`` (allocated when
    None), so the float32 temporaries stay small.
    """
    if not is_fp8(codes):
        raise TypeError(f"codes must be float8, not {codes.dtype}")
    if codes.dim() < 2:
        raise ValueError(f"codes must have 2 or more dimensions, not shape {tuple(codes.shape)}")
    check_fp8_pair(codes, scale)
    srows, bm, scols, bn = _grid(codes, scale)
    if out is None:
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    elif out.shape != codes.shape or out.dtype != dtype:
        raise ValueError(f"out must be {tuple(codes.shape)} {dtype}, not {tuple(out.shape)} {out.dtype}")
    if codes.numel() == 0:
        return out  # nothing to write (and no band to reshape into: a size is 0)
    if _dequantize_native(codes, scale, out, srows, scols):
        return out
    s = scale_as_float32(scale if scale.dim() >= 2 else scale.reshape(1, 1))
    q = codes.reshape(-1, srows, bm, scols, bn)
    s = s.reshape(-1, srows, scols).unsqueeze(-1).unsqueeze(2)
    o = out.view(-1, srows, bm, scols, bn)
    lead = q.shape[0]
    per_band = bm * scols * bn
    step = max(1, _CHUNK_ELEMENTS // max(per_band, 1))
    for e in range(lead):
        for r in range(0, srows, step):
            band = slice(r, min(r + step, srows))
            o[e, band].copy_(q[e, band].to(torch.float32) * s[min(e, s.shape[0] - 1), band])
    return out


# --- the native kernel --------------------------------------------------------------------------

_NATIVE_FORMATS = {getattr(torch, n): f for n, f in (("float8_e4m3fn", "e4m3fn"), ("float8_e5m2", "e5m2"))
                   if hasattr(torch, n)}
_NATIVE_OUTS = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# NaN float32 patterns a product can have: NaN codes widened (payloads), x86's default NaN.
_NAN_PROBES = (0x7FC00000, 0xFFC00000, 0x7FF00000, 0xFFF00000, 0x7FE00000, 0x7FA00000, 0x7F800001, 0xFFE00000)
_native_rules: dict[torch.dtype, int | None] | None = None


def _f16_nan(bits: int) -> int:
    """float16 bits of a NaN float32, as the kernel writes them: sign and top of the payload kept, quiet."""
    return ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)


def _native_nan_rules() -> dict[torch.dtype, int | None]:
    """For each output dtype, what torch's CPU conversion of a NaN float32 writes,
    in the kernel's terms: the bfloat16 pattern of every NaN (0xFFFF from
    torch's AVX2/AVX-512 kernels, 0x7FC0 from c10::BFloat16), 0 where float16
    keeps the payload as the kernel does; None where torch does something the
    kernel does not (that dtype then takes the torch path). Probed once, with
    the op the torch path uses (``copy_`` from float32), long enough to run
    vectorized and tail elements."""
    global _native_rules
    if _native_rules is None:
        probe = torch.tensor(_NAN_PROBES, dtype=torch.int64).to(torch.int32)  # wraps to the bit patterns
        f = probe.view(torch.float32).repeat(9)
        bits = [b & 0xFFFFFFFF for b in probe.tolist()] * 9
        got = {}
        for dtype in (torch.bfloat16, torch.float16):
            out = torch.empty(f.shape, dtype=dtype)
            out.copy_(f)
            got[dtype] = [v & 0xFFFF for v in out.view(torch.int16).tolist()]
        bf16 = set(got[torch.bfloat16])
        _native_rules = {
            torch.bfloat16: bf16.pop() if len(bf16) == 1 else None,
            torch.float16: 0 if got[torch.float16] == [_f16_nan(b) for b in bits] else None,
            torch.float32: 0,
        }
    return _native_rules


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tracing() -> bool:
    """torch.compile / export / torch.jit.trace at work: torch's ops are recorded,
    a native call on raw memory is not (a trace would keep an empty buffer)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling is not None and is_compiling()) or torch.jit.is_tracing()


def _dequantize_native(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, srows: int, scols: int) -> bool:
    """Run the native kernel when it applies (plain CPU tensors with memory,
    contiguous, a dtype it writes, no autograd on the scale, not tracing);
    True when it ran."""
    fmt = _NATIVE_FORMATS.get(codes.dtype)
    kind = _NATIVE_OUTS.get(out.dtype)
    if fmt is None or kind is None or codes.numel() == 0:
        return False
    # Subclasses (FakeTensor, FunctionalTensor, wrappers) may have no memory behind data_ptr().
    if not all(type(t) in _PLAIN for t in (codes, scale, out)) or _tracing():
        return False
    if codes.device.type != "cpu" or scale.device.type != "cpu" or out.device.type != "cpu":
        return False
    if not (codes.is_contiguous() and out.is_contiguous()) or out.requires_grad:
        return False
    if scale.requires_grad and torch.is_grad_enabled():
        return False
    nan = _native_nan_rules()[out.dtype]
    if nan is None:
        return False
    s = scale_as_float32(scale).contiguous()
    if s.data_ptr() % s.element_size():
        s = s.clone()  # packed unaligned in its file (safetensors asks no alignment): the kernel reads aligned
    if bool(s.isnan().any()):
        return False  # a NaN code times a NaN scale keeps one payload: torch's operand order decides which
    rows, cols = codes.shape[-2:]
    lead = codes.numel() // (rows * cols)
    scale_lead = s.numel() // (srows * scols)
    if scale_lead not in (1, lead) or s.numel() != scale_lead * srows * scols:
        return False
    from .._env import env_number
    from .._native import _core

    threads = env_number("MAPOFFLOAD_FP8_THREADS", low=1, high=64, integer=True)
    _core.dequantize_fp8(codes.data_ptr(), s.data_ptr(), out.data_ptr(), lead=lead, rows=rows, cols=cols,
                         scale_lead=scale_lead, srows=srows, scols=scols, fp8_format=fmt, out_dtype=kind,
                         bf16_nan=nan if out.dtype == torch.bfloat16 else 0x7FC0,
                         threads=int(threads) if threads is not None else torch.get_num_threads())
    return True


class Fp8Dequantize(torch.nn.Module):
    """The parametrization: ``weight = dequantize_fp8(original, scale)``; the
    scale is its parameter, so a layer's scales stream with its codes."""

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.dtype = dtype
        self.casts: list[torch.dtype] = []  # the model's conversions since (model.half(): _KeptCodes), in turn
        # While the owning module computes (hooks set by attach_fp8), a weight read
        # again (an MoE's experts, indexed once per expert hit) is dequantized once.
        self._hold = False
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        workspace().own(self)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        memo = self._memo
        if memo is not None and memo[0] is codes and memo[1] is self.scale:
            return memo[2]
        out = None
        if codes.device.type == "cpu" and type(codes) in _PLAIN and not _tracing() and not (
                self.scale.requires_grad and torch.is_grad_enabled()):
            # A reused working buffer nothing else holds (fp8_workspace), not fresh memory each time.
            out = workspace().take(codes.shape, self.dtype)
        out = dequantize_fp8(codes, self.scale, dtype=self.dtype, out=out)
        for dtype in self.casts:  # each rounding the plain model's weight went through
            out = out.to(dtype)
        if self._hold:
            self._memo = (codes, self.scale, out)
        return out

    def hold(self, on: bool) -> None:
        """Keep the last dequantization while the owner computes (on), drop it (off)."""
        self._hold = on
        if not on:
            self._memo = None

    def extra_repr(self) -> str:
        casts = "".join(f" -> {d}" for d in self.casts)
        return f"dtype={self.dtype}{casts}, scale grid {tuple(self.scale.shape)}"


def attach_fp8(module: torch.nn.Module, name: str, codes: torch.Tensor, scale: torch.Tensor, *,
               dtype: torch.dtype, key: str | None = None) -> None:
    """Make ``module.<name>`` the dequantization of ``codes`` with ``scale``.

    ``codes`` and ``scale`` are kept as they are (views of a file mapping stay
    views): ``module.parametrizations.<name>.original`` holds the codes, the
    parametrization's ``scale`` the scales. Reading ``module.<name>``
    dequantizes into ``dtype``. Raises ``CheckpointError`` naming ``key``
    (default ``name``: the weight's state-dict key, where the caller knows
    it) and both shapes when the scale grid does not fit the codes in every
    dimension or its dtype is not one transformers decodes; ``TypeError``
    when ``codes`` is not float8.
    """
    from torch.nn.utils import parametrize

    from .files import CheckpointError

    if not is_fp8(codes):
        raise TypeError(f"{name}: codes must be float8, not {codes.dtype}")
    try:
        check_fp8_pair(codes, scale)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(key or name, f"codes {tuple(codes.shape)} {codes.dtype}, scale "
                                           f"{tuple(scale.shape)} {scale.dtype}: {exc}") from None
    if parametrize.is_parametrized(module, name):
        raise ValueError(f"{name} of {type(module).__name__} is already parametrized")
    module._parameters.pop(name, None)
    module.register_parameter(name, torch.nn.Parameter(codes, requires_grad=False))
    dequant = Fp8Dequantize(scale, dtype)
    parametrize.register_parametrization(module, name, dequant, unsafe=True)
    module.parametrizations[name].__class__ = _KeptCodes  # model.half() converts it as the plain model's
    module.register_forward_pre_hook(lambda _m, _a: dequant.hold(True))
    module.register_forward_hook(lambda _m, _a, _o: dequant.hold(False), always_call=True)
    module._register_state_dict_hook(_StateDictAsWeight(name))
    module._register_load_state_dict_pre_hook(_LoadCodes(name), with_module=True)


class _KeptCodes(parametrize.ParametrizationList):
    """An fp8 weight's parametrization, whose ``Module._apply`` (``model.half()``, ``.float()``, ``.to(dtype,
    device)``) converts the weight as the dequantized model's would - dequantized as loaded, then cast
    through every conversion made since, each rounding as the plain model's weight did - while its codes
    and scales stay what they are (fp8, and views of the file), moved only where the device changes.
    ``Module._apply`` itself cast the codes like any floating weight, and every later forward raised
    (``codes must be float8``). A manager's placeholder in place of the codes takes the call itself (its
    refusal). The class of the list (not an attribute of it): a copy of the model converts itself."""

    def _apply(self, fn, recurse: bool = True):
        codes, dequant = self.original, self[0]
        if type(codes) not in _PLAIN:
            return super()._apply(fn, recurse)
        now = dequant.casts[-1] if dequant.casts else dequant.dtype
        probe = fn(torch.empty(0, dtype=now, device=codes.device))  # what it does to the weight as it is
        if probe.device != codes.device:
            super()._apply(lambda t: t.to(probe.device), recurse)
        if probe.is_floating_point() and probe.dtype != now:
            dequant.casts.append(probe.dtype)
            dequant.hold(False)
        return self


class _StateDictAsWeight:
    """``state_dict()`` names the weight as the module without the
    parametrization does — ``<name>``, its dequantized value, as transformers'
    model has it (so ``save_pretrained`` writes what transformers' own save of
    its dequantized model writes) — not ``parametrizations.<name>.original``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: torch.nn.Module, state: dict, prefix: str, _meta: object) -> None:
        codes = state.pop(f"{prefix}parametrizations.{self.name}.original", None)
        state.pop(f"{prefix}parametrizations.{self.name}.0.scale", None)
        if codes is not None:
            with torch.no_grad():
                state[f"{prefix}{self.name}"] = getattr(module, self.name).detach()


class _LoadCodes:
    """``load_state_dict`` takes ``<name>`` as fp8 codes with ``<name>_scale_inv``
    (the checkpoint layout); a dequantized ``<name>`` cannot go back into codes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: torch.nn.Module, state: dict, prefix: str, *_rest: object) -> None:
        key = f"{prefix}{self.name}"
        if key not in state:
            return
        value = state.pop(key)
        scale = state.pop(f"{key}_scale_inv", None)
        if not is_fp8(value) or scale is None:
            raise RuntimeError(f"{key} is kept as fp8 codes: load_state_dict needs its codes (float8) and "
                               f"{key}_scale_inv, not a {value.dtype} weight")
        state[f"{prefix}parametrizations.{self.name}.original"] = value
        state[f"{prefix}parametrizations.{self.name}.0.scale"] = scale


def fp8_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, Fp8Dequantize]]:
    """``(qualified name, codes, parametrization)`` for every fp8 weight of ``model``
    (the codes are ``parametrizations.<name>.original``, the scales ``parametrization.scale``)."""
    for mod_name, module in model.named_modules():
        lists = getattr(module, "parametrizations", None)
        if lists is None:
            continue
        for attr, plist in lists.items():
            dequant = next((p for p in plist if isinstance(p, Fp8Dequantize)), None)
            if dequant is not None:
                yield (f"{mod_name}.{attr}" if mod_name else attr), plist.original, dequant


E4M3_MAX = 448.0


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | str = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, weight_scale_inv)`` of a 2-D weight in the fine-grained FP8
    layout: ``float8_e4m3fn`` codes and a float32 scale per ``block`` tile
    (ragged tiles at the edges), per row (``"channel"``) or one for the tensor
    (``"tensor"``); the tile's largest magnitude maps to 448. The inverse of
    :func:`dequantize_fp8` up to fp8 rounding (to make test and benchmark
    checkpoints; transformers' own ``Fp8Quantize`` is the reference for models
    it saves)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, not shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    shapes = {"channel": (1, cols), "tensor": (rows, cols)}
    if isinstance(block, str) and block not in shapes:
        raise ValueError(f"block must be (rows, cols), 'channel' or 'tensor', not {block!r}")
    bm, bn = shapes[block] if isinstance(block, str) else block
    x = torch.nn.functional.pad(weight.float(), (0, -cols % bn, 0, -rows % bm))
    tiles = x.view(x.shape[0] // bm, bm, x.shape[1] // bn, bn)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    codes = (tiles / scale[:, None, :, None]).view_as(x)[:rows, :cols].to(torch.float8_e4m3fn)
    return codes.contiguous(), scale
