"""The native fused FP8 dequantization (csrc/fp8.*, csrc/fp8_lookup.*)
against its pure-torch reference: transformers' formula
``(codes.to(float32) * scale_per_block).to(dtype)``, bit for bit, for every
code of both formats times hundreds of scales (subnormal, tie and overflow
outputs included), on every path of the kernel (the SIMD table lookup, the
portable table lookup, the per-element loop; one thread or several); the
layouts dequantize_fp8 hands it; what falls back to torch; bad inputs."""

from __future__ import annotations

import errno
import mmap
import os
import platform
import random

import pytest

torch = pytest.importorskip("torch")

from mapoffload import MappingFaultError  # noqa: E402
from mapoffload.loading import fp8  # noqa: E402
from mapoffload._native import _core  # noqa: E402
from mapoffload.loading.fp8 import dequantize_fp8  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {E4M3: "e4m3fn", E5M2: "e5m2"}
OUTS = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def reference(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' arithmetic, in torch, on the whole tensor at once."""
    rows, cols = codes.shape[-2:]
    s = scale.to(torch.float32)
    s = s if s.dim() >= 2 else s.reshape(1, 1)
    s = s.repeat_interleave(rows // s.shape[-2], dim=-2).repeat_interleave(cols // s.shape[-1], dim=-1)
    return (codes.to(torch.float32) * s).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def first_difference(got: torch.Tensor, want: torch.Tensor, codes: torch.Tensor, scale_of_row) -> str:
    g, w = got.view(BITS[got.dtype]).flatten(), want.view(BITS[want.dtype]).flatten()
    i = int((g != w).nonzero()[0])
    cols = got.shape[-1]
    code = int(codes.view(torch.uint8).flatten()[i])
    return (f"element {i}: code 0x{code:02x} x scale {scale_of_row(i // cols)!r}: "
            f"native 0x{int(g[i]) & 0xFFFFFFFF:x}, torch 0x{int(w[i]) & 0xFFFFFFFF:x}")


def _cpuinfo_flags() -> set[str]:
    """The first CPU's ``flags`` line of /proc/cpuinfo (empty where there is none: not x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


HAS_VBMI = platform.machine() in ("x86_64", "AMD64") and {"avx512f", "avx512bw", "avx512vbmi"} <= _cpuinfo_flags()
needs_vbmi = pytest.mark.skipif(
    not HAS_VBMI, reason="this CPU lacks AVX-512 VBMI (/proc/cpuinfo): the SIMD lookup cannot run here; "
                         "simd=True runs the portable loop, which the 'table' cases test")


def native(codes, scale, out, *, threads=0, simd=True, nan=None):
    """_core.dequantize_fp8 on tensors (scale already float32 and contiguous)."""
    rows, cols = codes.shape[-2:]
    srows, scols = scale.shape[-2:]
    if nan is None:
        nan = fp8._native_nan_rules()[torch.bfloat16] or 0x7FC0
    _core.dequantize_fp8(codes.data_ptr(), scale.data_ptr(), out.data_ptr(), lead=codes.numel() // (rows * cols),
                         rows=rows, cols=cols, scale_lead=scale.numel() // (srows * scols), srows=srows, scols=scols,
                         fp8_format=FORMATS[codes.dtype], out_dtype=OUTS[out.dtype], bf16_nan=nan, threads=threads,
                         simd=simd)
    return out


def exhaustive_scales() -> list[float]:
    """Several hundred float32 scales: powers of two from subnormal to huge
    (products that underflow to zero, land on float16/bfloat16 subnormals,
    overflow to infinity), scales of few significant bits (products exactly
    halfway between two outputs: ties to even), random ones, signs, zeros."""
    scales = [0.0, -0.0, 1.0, -1.0, 2.0**-149, 2.0**-126, 3 * 2.0**-140, 2.0**127, 1.5 * 2.0**127]
    scales += [2.0**e for e in range(-149, 128, 3)]
    scales += [(1 + k / 4096) * 2.0**e for k in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 2047, 2048, 2049)
               for e in (-30, -24, -20, -16, -12, -6, 0, 6, 10, 12, 14)]
    scales += [(1 + k / 256) * 2.0**e for k in (1, 3, 127, 128, 129, 255) for e in (-133, -120, 100, 113, 120)]
    rng = random.Random(17)
    scales += [rng.choice((1, -1)) * 2.0 ** rng.uniform(-40, 40) for _ in range(120)]
    scales += [rng.uniform(1e-5, 1e-3) for _ in range(40)]  # a checkpoint's weight_scale_inv
    return torch.tensor(scales, dtype=torch.float32).tolist()  # as float32 values


SCALES = exhaustive_scales()


@pytest.fixture(scope="module", params=[E4M3, E5M2], ids=["e4m3fn", "e5m2"])
def fmt(request):
    return request.param


def all_codes(fmt, rows: int, cols: int) -> torch.Tensor:
    """Every code, cycling along each row, shifted by one per row."""
    idx = (torch.arange(rows)[:, None] + torch.arange(cols)[None, :]) % 256
    return idx.to(torch.uint8).view(fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("path", [pytest.param("simd", marks=needs_vbmi), "table", "per-element"])
def test_every_code_times_hundreds_of_scales_is_torch_bit_for_bit(fmt, dtype, path):
    """One scale a row. 'table': rows of 4096 + 100 codes share a scale (a table
    of finished outputs per scale, the ragged 100 a SIMD tail); 'per-element': rows
    of 256 (too few to pay for a table: multiplied and rounded per element)."""
    assert len(SCALES) >= 300
    cols = 256 if path == "per-element" else 4196
    codes = all_codes(fmt, len(SCALES), cols)
    scale = torch.tensor(SCALES, dtype=torch.float32)[:, None]
    want = reference(codes, scale, dtype)
    for threads in (1, 2):
        got = native(codes, scale, torch.empty(codes.shape, dtype=dtype), threads=threads, simd=path == "simd")
        assert same_bits(got, want), first_difference(got, want, codes, lambda r: SCALES[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
def test_every_code_with_one_scale_for_the_tensor(fmt, dtype):
    """Per-tensor scales through the public function: a 0-d scale, a [1, 1] one."""
    codes = all_codes(fmt, 4, 256)
    for s in SCALES[::7]:
        for scale in (torch.tensor(s), torch.tensor([[s]])):
            got = dequantize_fp8(codes, scale, dtype=dtype)
            assert same_bits(got, reference(codes, scale, dtype)), s


def test_the_values_are_torch_conversion_of_every_code(fmt):
    """Scale 1, float32 out: the kernel's value of each code is exactly torch's
    float8 -> float32 (NaN payloads, signed zeros, e5m2's infinities)."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt).reshape(1, 256)
    got = native(codes, torch.ones(1, 1), torch.empty(1, 256))
    assert torch.equal(got.view(torch.int32), codes.to(torch.float32).view(torch.int32))


def test_nan_rules_are_what_torch_writes():
    """bfloat16: torch's CPU kernels write one pattern for every NaN (0xFFFF
    vectorized, 0x7FC0 c10::BFloat16); float16 keeps the payload."""
    rules = fp8._native_nan_rules()
    assert rules[torch.bfloat16] in (0xFFFF, 0x7FC0)
    nans = torch.tensor([0x7FC00000, 0x7FF00000, 0x7FA00000], dtype=torch.int32).view(torch.float32)
    assert {int(v) & 0xFFFF for v in nans.bfloat16().view(torch.int16)} == {rules[torch.bfloat16]}
    assert rules[torch.float16] == 0 and rules[torch.float32] == 0


def _codes(shape, fmt=E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(fmt)


def _scales(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 1e-3 + 1e-5


@pytest.fixture
def calls(monkeypatch):
    """Counts the native kernel's calls through dequantize_fp8."""
    seen = []
    real = _core.dequantize_fp8
    monkeypatch.setattr(_core, "dequantize_fp8", lambda *a, **k: seen.append(k) or real(*a, **k))
    return seen


@pytest.mark.parametrize("shape,grid", [
    ((3584, 1024), (28, 8)),        # [128, 128] blocks
    ((1024, 1024), (8, 8)),
    ((200, 300), (2, 3)),           # [100, 100]: the block is the shape over the grid, as transformers derives it
    ((256, 96), (2, 3)),            # [128, 32]: runs shorter than a SIMD register
    ((64, 96), (1, 1)),             # per tensor
    ((300, 1000), (1, 1)),          # per tensor, rows not a multiple of 64
    ((64, 96), (64, 1)),            # per channel, short rows: per element
    ((512, 2048), (512, 1)),        # per channel, long rows: a table per row
    ((128, 4096), (1, 4096)),       # per column
    ((4, 256, 128), (4, 2, 1)),     # stacked experts, a grid each
    ((4, 256, 128), (2, 1)),        # stacked experts sharing one grid
    ((2, 3, 128, 256), (2, 3, 1, 2)),  # two leading dims
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
def test_layouts_equal_the_torch_path(shape, grid, dtype, calls):
    codes, scale = _codes(shape), _scales(grid)
    want = reference(codes, scale, dtype)
    got = dequantize_fp8(codes, scale, dtype=dtype)
    assert len(calls) == 1 and same_bits(got, want)
    assert calls[0]["threads"] == torch.get_num_threads()
    for threads in (1, 3, 7):  # uneven splits, mid-band
        for simd in (True, False):
            assert same_bits(native(codes, scale.contiguous(), torch.empty(shape, dtype=dtype), threads=threads,
                                    simd=simd), want)


def test_e5m2_and_a_non_float32_scale():
    codes = _codes((256, 512), E5M2)
    scale = _scales((2, 4)).to(torch.bfloat16)  # converted to float32 first, as the torch path does
    assert same_bits(dequantize_fp8(codes, scale, dtype=torch.bfloat16), reference(codes, scale, torch.bfloat16))
    scale64 = _scales((2, 4)).double() / 3  # rounds to float32 first
    assert same_bits(dequantize_fp8(codes, scale64, dtype=torch.float16), reference(codes, scale64, torch.float16))


def test_out_is_reused_across_calls(calls):
    out = torch.full((512, 256), float("nan"), dtype=torch.bfloat16)
    for seed in range(3):
        codes, scale = _codes((512, 256), seed=seed), _scales((4, 2), seed=seed + 10)
        assert dequantize_fp8(codes, scale, dtype=torch.bfloat16, out=out) is out
        assert same_bits(out, reference(codes, scale, torch.bfloat16))
    assert len(calls) == 3
    with pytest.raises(ValueError, match="out must be"):
        dequantize_fp8(_codes((512, 256)), _scales((4, 2)), dtype=torch.float16, out=out)
    # A contiguous view into a larger buffer is written in place, nothing around it.
    big = torch.zeros(3, 512, 256, dtype=torch.float32)
    codes, scale = _codes((512, 256)), _scales((4, 2))
    got = dequantize_fp8(codes, scale, dtype=torch.float32, out=big[1])
    assert got.data_ptr() == big[1].data_ptr() and got.shape == (512, 256)  # out itself, not a new tensor
    assert same_bits(big[1], reference(codes, scale, torch.float32))
    assert not big[0].any() and not big[2].any()


def test_what_the_kernel_does_not_take_goes_through_torch(calls):
    # No NaN codes here: torch itself writes a NaN's bfloat16 as 0xFFFF in its
    # vectorized conversion and 0x7FC0 in its scalar one, and which runs
    # depends on the layout (the torch path copies strided bands).
    codes, scale = _codes((256, 256)), _scales((2, 2))
    codes = torch.where(codes.float().isnan(), 0, codes.view(torch.uint8)).to(torch.uint8).view(E4M3)
    # Strided codes, a strided out, another dtype: torch's ops, same result.
    t = codes.t()
    assert same_bits(dequantize_fp8(t, scale, dtype=torch.bfloat16), reference(t, scale, torch.bfloat16))
    out = torch.empty(256, 512, dtype=torch.bfloat16)[:, ::2]
    dequantize_fp8(codes, scale, dtype=torch.bfloat16, out=out)
    assert same_bits(out.contiguous(), reference(codes, scale, torch.bfloat16))
    got = dequantize_fp8(codes, scale, dtype=torch.float64)
    assert torch.equal(got, reference(codes, scale, torch.float64))
    # A scale the kernel could read that the torch path refuses stays refused, by name.
    with pytest.raises(ValueError, match=r"scale grid \(4,\) does not fit weight \(4, 128, 128\)"):
        dequantize_fp8(_codes((4, 128, 128)), _scales((4,)), dtype=torch.bfloat16)
    assert calls == []


def test_a_scale_that_needs_grad_goes_through_torch(calls):
    codes = _codes((128, 128))
    scale = _scales((1, 1)).requires_grad_()
    got = dequantize_fp8(codes, scale, dtype=torch.float32)
    assert got.requires_grad and calls == []
    with torch.no_grad():
        dequantize_fp8(codes, scale, dtype=torch.float32)
    assert len(calls) == 1


def test_shapes_not_divisible_by_the_grid_raise_the_same_error():
    with pytest.raises(ValueError, match=r"weight shape \(10, 10\) is not divisible by its scale grid \(3, 1\)"):
        dequantize_fp8(_codes((10, 10)), _scales((3, 1)), dtype=torch.bfloat16)


class Buffers:
    """Real memory for the bad-input calls: validation must refuse before any read."""

    def __init__(self):
        self.codes = _codes((128, 128))
        self.scale = _scales((1, 1))
        self.out = torch.empty(128, 128, dtype=torch.bfloat16)

    def call(self, **over):
        kw = dict(codes=self.codes.data_ptr(), scale=self.scale.data_ptr(), out=self.out.data_ptr(), lead=1,
                  rows=128, cols=128, scale_lead=1, srows=1, scols=1, fp8_format="e4m3fn", out_dtype="bfloat16")
        kw.update(over)
        a = (kw.pop("codes"), kw.pop("scale"), kw.pop("out"))
        _core.dequantize_fp8(*a, **kw)


@pytest.mark.parametrize("over,match", [
    (dict(codes=0), "not 0"),
    (dict(out=0), "not 0"),
    (dict(rows=0), "sizes must be positive"),
    (dict(scols=0), "sizes must be positive"),
    (dict(lead=0), "sizes must be positive"),
    (dict(srows=3), r"\(128, 128\) is not divisible by its scale grid \(3, 1\)"),
    (dict(scols=256), "not divisible"),
    (dict(lead=2, scale_lead=3), "scale_lead must be 1 or lead"),
    (dict(lead=1 << 40, rows=1 << 20, cols=1 << 20), "overflow"),
    (dict(scale_offset=2), "scale must be float32-aligned"),
    (dict(out_offset=1), "out must be aligned"),
    (dict(out="codes"), "out overlaps"),
    (dict(fp8_format="e3m4"), "fp8 format must be"),
    (dict(out_dtype="float64"), "output dtype must be"),
    (dict(bf16_nan=1 << 16), "bf16_nan must be"),
])
def test_bad_inputs_raise_value_errors(over, match):
    b = Buffers()
    if "scale_offset" in over:
        over = dict(scale=b.scale.data_ptr() + over.pop("scale_offset"))
    if "out_offset" in over:
        over = dict(out=b.out.data_ptr() + over.pop("out_offset"))
    if over.get("out") == "codes":
        over = dict(out=b.codes.data_ptr() + 64)
    with pytest.raises(ValueError, match=match):
        b.call(**over)


def test_addresses_and_sizes_must_be_non_negative_ints():
    b = Buffers()
    for bad in (dict(rows=-1), dict(codes=-8), dict(threads=-1)):
        with pytest.raises(TypeError, match="incompatible function arguments"):  # pybind11: not an unsigned int
            b.call(**bad)


def test_a_truncated_mapped_file_raises_and_the_process_lives(tmp_path):
    """Codes on a file mapping whose file was truncated: MappingFaultError
    naming the file (the SIGBUS guard on every kernel thread), not a crash."""
    path = tmp_path / "codes.bin"
    path.write_bytes(os.urandom(1024 * 1024))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    codes = torch.frombuffer(m, dtype=torch.uint8).view(E4M3).reshape(1024, 1024)
    scale = _scales((8, 8))
    want = reference(codes, scale, torch.bfloat16)
    assert same_bits(dequantize_fp8(codes, scale, dtype=torch.bfloat16), want)
    os.truncate(path, 4096)
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            with pytest.raises(MappingFaultError, match="of a mapped file") as info:
                dequantize_fp8(codes, scale, dtype=torch.bfloat16)
        finally:
            torch.set_num_threads(before)
        assert info.value.filename == str(path) and info.value.errno == errno.EIO
    # Still usable afterwards.
    c2 = _codes((512, 512))
    assert same_bits(dequantize_fp8(c2, scale, dtype=torch.bfloat16), reference(c2, scale, torch.bfloat16))
    del codes
    m.close()


def test_simd_names_what_it_runs():
    """'avx512vbmi' exactly where this CPU and OS run AVX-512 VBMI, '' elsewhere (simd=True then runs the
    portable loop).

    The independent reading is the kernel's: csrc/fp8_lookup.cpp asks libgcc's ``__builtin_cpu_supports``
    for avx512f, avx512bw and avx512vbmi (compiled for x86-64 only), which checks that the OS saves the
    zmm state (XCR0); the kernel drops the avx512* flags from /proc/cpuinfo where it does not enable that
    state (XSAVE off, ``noxsave``, a hypervisor's mask), so the three flags there are the same question.
    No environment variable overrides it."""
    flags = _cpuinfo_flags()
    want = "avx512vbmi" if HAS_VBMI else ""
    assert _core.fp8_simd() == want, (platform.machine(), sorted(f for f in flags if f.startswith("avx512")))


def test_tracing_takes_the_torch_path(calls):
    """torch.compile traces torch's ops (a native call on raw memory would break the graph)."""
    from mapoffload.loading.fp8 import attach_fp8

    lin = torch.nn.Linear(256, 128, bias=False)
    codes = _codes((128, 256))
    codes = torch.where(codes.float().isnan(), 0, codes.view(torch.uint8)).to(torch.uint8).view(E4M3)
    attach_fp8(lin, "weight", codes, _scales((1, 2)), dtype=torch.float32)
    x = torch.randn(3, 256)
    with torch.no_grad():
        want = lin(x)
        assert len(calls) == 1
        calls.clear()
        got = torch.compile(lin, backend="eager")(x)
    assert torch.equal(got, want) and calls == []


def test_threads_follow_torch_unless_the_variable_says(calls, monkeypatch):
    from mapoffload._env import EnvSettingError

    codes, scale = _codes((256, 256)), _scales((2, 2))
    dequantize_fp8(codes, scale, dtype=torch.bfloat16)
    monkeypatch.setenv("MAPOFFLOAD_FP8_THREADS", "3")
    dequantize_fp8(codes, scale, dtype=torch.bfloat16)
    assert [c["threads"] for c in calls] == [torch.get_num_threads(), 3]
    monkeypatch.setenv("MAPOFFLOAD_FP8_THREADS", "0")
    with pytest.raises(EnvSettingError, match="MAPOFFLOAD_FP8_THREADS"):
        dequantize_fp8(codes, scale, dtype=torch.bfloat16)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:.*torch.jit.trace. is deprecated:DeprecationWarning")
def test_jit_trace_records_the_torch_path(calls):
    codes = _codes((128, 256))
    codes = torch.where(codes.float().isnan(), 0, codes.view(torch.uint8)).to(torch.uint8).view(E4M3)
    scale = _scales((1, 2))
    traced = torch.jit.trace(lambda c, s: dequantize_fp8(c, s, dtype=torch.float32) * 1, (codes, scale),
                             check_trace=False)
    assert calls == []
    other = _codes((128, 256), seed=5)
    other = torch.where(other.float().isnan(), 0, other.view(torch.uint8)).to(torch.uint8).view(E4M3)
    assert torch.equal(traced(other, scale), reference(other, scale, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("nan", [0x7FC00001, 0xFFC00000, 0x7F800001], ids=["payload", "negative", "signaling"])
def test_a_nan_scale_times_nan_codes_is_torch_bit_for_bit(fmt, dtype, nan):
    # Both operands NaN: which payload the product keeps is the multiply's
    # operand order, torch's and not the kernel's to choose.
    codes = all_codes(fmt, 128, 1024)
    scale = torch.tensor([nan], dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(1, 1).repeat(1, 4)
    scale[0, 1] = 0.5
    got = dequantize_fp8(codes, scale, dtype=dtype)
    want = reference(codes, scale, dtype)
    assert same_bits(got, want), first_difference(got, want, codes, lambda r: scale[0].tolist())


@pytest.mark.parametrize("shape", [(0, 128), (128, 0), (0, 0), (2, 0, 128)])
def test_a_weight_with_no_rows_or_no_columns_is_empty(shape):
    codes = torch.empty(shape, dtype=E4M3)
    got = dequantize_fp8(codes, torch.ones(1, 1), dtype=torch.bfloat16)
    assert got.shape == codes.shape and got.dtype == torch.bfloat16
