"""FP8 weights at one byte a parameter: dequantization against transformers'
own arithmetic, the parametrization, hand-built models through
load_checkpoint and the manager (in place and through the copier), the
transformers entry point."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from mapoffload import LayerwiseOffloadManager, MappedRegions, load_checkpoint  # noqa: E402
from mapoffload.loading.fp8 import attach_fp8, dequantize_fp8, fp8_weights  # noqa: E402

from fp8_models import E4M3, Stack  # noqa: E402
from fp8_models import random_codes as _codes, random_scales as _scales  # noqa: E402
from fp8_models import transformers_dequant as _transformers_dequant  # noqa: E402


@pytest.mark.parametrize("shape,grid", [
    ((256, 384), (2, 3)),        # [128, 128] blocks
    ((200, 300), (2, 3)),        # ragged: the block is the shape over the grid, as transformers derives it
    ((64, 96), (1, 1)),          # per tensor
    ((64, 96), (64, 1)),         # per channel
    ((4, 256, 128), (4, 2, 1)),  # stacked experts
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_is_transformers_bit_for_bit(shape, grid, dtype, monkeypatch):
    from mapoffload.loading import fp8

    codes, scale = _codes(shape), _scales(grid)
    want = _transformers_dequant(codes, scale, dtype)
    assert torch.equal(dequantize_fp8(codes, scale, dtype=dtype), want)
    # The torch path (CUDA, strided, ...), the only one that goes in bands: the
    # native kernel takes every CPU case here, so it is turned off to reach it.
    native = []
    monkeypatch.setattr(fp8, "_dequantize_native", lambda *a: native.append(1) and False)
    out = torch.empty(shape, dtype=dtype)
    assert dequantize_fp8(codes, scale, dtype=dtype, out=out) is out and torch.equal(out, want)
    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 1)  # one band of block rows at a time
    out = torch.empty(shape, dtype=dtype)
    assert dequantize_fp8(codes, scale, dtype=dtype, out=out) is out and torch.equal(out, want)
    assert native == [1, 1]  # both calls asked, and were refused, the native kernel


def test_scalar_scale_and_e5m2():
    codes = _codes((32, 16), dtype=torch.float8_e5m2)
    scale = torch.tensor(0.125)
    assert torch.equal(dequantize_fp8(codes, scale, dtype=torch.bfloat16), (codes.float() * 0.125).bfloat16())


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="float8"):
        dequantize_fp8(torch.zeros(4, 4), torch.ones(1, 1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not divisible"):
        dequantize_fp8(_codes((10, 10)), _scales((3, 1)), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_fp8(_codes((4, 4)), _scales((1, 1)), dtype=torch.bfloat16, out=torch.empty(4, 4))
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="weight: codes must be float8"):
        attach_fp8(lin, "weight", torch.zeros(4, 4), torch.ones(1, 1), dtype=torch.float32)


def test_attach_makes_the_weight_its_dequantization():
    lin = torch.nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    codes, scale = _codes((128, 256)), _scales((1, 2))
    attach_fp8(lin, "weight", codes, scale, dtype=torch.bfloat16)
    assert torch.equal(lin.weight, dequantize_fp8(codes, scale, dtype=torch.bfloat16))
    params = dict(lin.named_parameters())
    original = params["parametrizations.weight.original"]
    assert original.dtype == E4M3 and original.data_ptr() == codes.data_ptr()  # the codes kept, not copied
    assert original.shape == codes.shape and not original.requires_grad
    assert params["parametrizations.weight.0.scale"].data_ptr() == scale.data_ptr()  # kept, not copied
    x = torch.randn(3, 256).bfloat16()
    ref = torch.nn.functional.linear(x, dequantize_fp8(codes, scale, dtype=torch.bfloat16), lin.bias)
    assert torch.equal(lin(x), ref)
    assert [n for n, _, _ in fp8_weights(lin)] == ["weight"]
    with pytest.raises(ValueError, match="already parametrized"):
        attach_fp8(lin, "weight", codes, scale, dtype=torch.bfloat16)


# --- hand-built models: load_checkpoint + the manager -----------------------------------------------


def _fp8_checkpoint(path, width=256, depth=4):
    """A checkpoint of Stack with fp8 projections and [128, 128] scales; and
    the bf16 reference model holding their dequantization."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = Stack(width, depth).to(torch.bfloat16).eval()
    state = {}
    for name, t in ref.state_dict().items():
        if name.endswith(("up.weight", "down.weight")):
            rows, cols = t.shape
            codes, scale = _codes(t.shape, seed=len(state)), _scales((-(-rows // 128), -(-cols // 128)))
            state[name], state[name + "_scale_inv"] = codes, scale
            t.copy_(dequantize_fp8(codes, scale, dtype=torch.bfloat16))
        else:
            state[name] = t.contiguous()
    save_file(state, str(path))
    return ref


def _built(path):
    with mapoffload.empty_weights():
        model = Stack().to(torch.bfloat16).eval()
    report = load_checkpoint(model, str(path), keep_mapping=True)
    return model, report


def test_load_checkpoint_keeps_codes_and_scales_mapped(tmp_path):
    ref = _fp8_checkpoint(tmp_path / "m.safetensors")
    model, report = _built(tmp_path / "m.safetensors")
    assert report.fp8_weights == 8 and report.bytes_fp8 == 8 * 256 * 512
    assert report.bytes_fp8_scales == 8 * 8 * 4  # 4x2 or 2x4 blocks of float32 each
    assert report.bytes_copied == 0 and report.unexpected_keys == [] and report.missing_keys == []
    assert "fp8 weights kept as codes" in str(report)
    codes = [c for _, c, _ in fp8_weights(model)]
    assert all(MappedRegions().classify(codes)) and {c.dtype for c in codes} == {E4M3}
    x = torch.randn(2, 5, 256).bfloat16()
    with torch.no_grad():
        assert torch.equal(ref(x), model(x))


def test_fp8_codes_without_scales_into_a_wider_model_are_converted_as_before(tmp_path):
    """Plain float8 tensors (no scales) are like any dtype: an fp8 parameter maps them."""
    from safetensors.torch import save_file

    codes = _codes((8, 8))
    save_file({"weight": codes}, str(tmp_path / "w.safetensors"))
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(torch.empty(8, 8, dtype=E4M3), requires_grad=False)
    report = load_checkpoint(holder, str(tmp_path / "w.safetensors"), keep_mapping=True)
    assert report.fp8_weights == 0 and report.bytes_copied == 0 and MappedRegions().holds(holder.weight)


def test_a_scale_grid_that_does_not_fit_is_named(tmp_path):
    from safetensors.torch import save_file

    state = {f"blocks.{i}.{k}": v for i in range(4) for k, v in Stack(depth=1).blocks[0].state_dict().items()}
    state = {k: v.bfloat16() for k, v in state.items()}
    state["blocks.0.up.weight"] = _codes((512, 256))
    state["blocks.0.up.weight_scale_inv"] = _scales((3, 2))
    save_file(state, str(tmp_path / "bad.safetensors"))
    with mapoffload.empty_weights():
        model = Stack().to(torch.bfloat16)
    with pytest.raises(mapoffload.CheckpointError, match="up.weight_scale_inv.*not divisible"):
        load_checkpoint(model, str(tmp_path / "bad.safetensors"), keep_mapping=True)


@pytest.mark.parametrize("twin", [False, True])
def test_the_manager_streams_one_byte_a_parameter(tmp_path, twin):
    ref = _fp8_checkpoint(tmp_path / "m.safetensors")
    model, report = _built(tmp_path / "m.safetensors")
    x = torch.randn(2, 5, 256).bfloat16()
    with torch.no_grad():
        expected = ref(x)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin, host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        # The plan and the stores count what is read: one byte a weight, the scales, the norms.
        norms = 4 * 2 * 256 * 2
        assert mgr.mapped_bytes == report.bytes_fp8 + report.bytes_fp8_scales + norms
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(expected, model(x))
        if twin:  # through the copier: the codes' bytes cross, not a bf16 copy
            copied = mgr.copier.stats().bytes
            assert copied == 3 * mgr.mapped_bytes, copied
    with torch.no_grad():
        assert torch.equal(expected, model(x))  # whole again


_GROWTH = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from fp8_models import Stack, random_codes as _codes, random_scales as _scales
from safetensors.torch import save_file
import mapoffload
from mapoffload import LayerwiseOffloadManager, load_checkpoint
from mapoffload.memory.budget import rss_anon_bytes
torch.set_num_threads(1)
width, depth = 1024, 32
state = {}
for i in range(depth):
    for name, shape in (("up", (2 * width, width)), ("down", (width, 2 * width))):
        state[f"blocks.{i}.{name}.weight"] = _codes(shape, seed=i)
        state[f"blocks.{i}.{name}.weight_scale_inv"] = _scales((shape[0] // 128, shape[1] // 128))
    state[f"blocks.{i}.norm.weight"] = torch.ones(width, dtype=torch.bfloat16)
    state[f"blocks.{i}.norm.bias"] = torch.zeros(width, dtype=torch.bfloat16)
save_file(state, sys.argv[1])
del state
with mapoffload.empty_weights():
    model = Stack(width, depth).to(torch.bfloat16).eval()
load_checkpoint(model, sys.argv[1], keep_mapping=True)
x = torch.randn(1, 4, width).bfloat16()
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
mgr.register_forward_hooks()
import threading
with torch.no_grad():
    model(x)  # first forward: the file's pages come in (page cache, not anonymous)
    base = peak = rss_anon_bytes()
    done = threading.Event()
    def sample():
        global peak
        while not done.wait(0.001):
            peak = max(peak, rss_anon_bytes())
    t = threading.Thread(target=sample)
    t.start()
    for _ in range(3):
        model(x)
    done.set()
    t.join()
print(max(peak, rss_anon_bytes()) - base)
"""


@pytest.mark.slow
def test_anonymous_growth_stays_a_weight_whatever_the_depth(tmp_path):
    """32 layers of 8 MiB in bf16 (256 MiB dequantized): at its peak during three
    forwards, anonymous memory grows by at most two layers + 64 MiB, not by the model."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)  # glibc as it comes, as in a user's process (no MALLOC_* tuning)
    out = subprocess.run([sys.executable, "-c", _GROWTH, str(tmp_path / "m.safetensors"), os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=300, cwd="/", env=env)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    assert growth <= 2 * 8 * 2**20 + 64 * 2**20, growth


@pytest.mark.cuda
def test_streamed_to_cuda_equals_the_cpu_reference(tmp_path):
    """On a real device: the codes and scales cross (one byte a weight), the
    dequantization runs on the device, the output is the reference's."""
    ref = _fp8_checkpoint(tmp_path / "m.safetensors")
    model, _ = _built(tmp_path / "m.safetensors")
    x = torch.randn(2, 5, 256).bfloat16()
    with torch.no_grad():
        expected = ref(x)
    for m in model.modules():  # the rest (norms) and buffers on the device
        for name, p in m._parameters.items():
            if p is not None and p.dtype == torch.bfloat16:
                m._parameters[name] = torch.nn.Parameter(p.data.cuda(), requires_grad=False)
    with LayerwiseOffloadManager(model, "blocks", device="cuda", host_store="mapped") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            got = model(x.cuda()).cpu()
        assert mgr.copier.stats().bytes == mgr.mapped_bytes
    assert torch.allclose(expected.float(), got.float(), atol=2e-2, rtol=0)  # GPU kernels round differently


def test_a_weight_read_many_times_in_one_forward_is_dequantized_once(monkeypatch):
    """An MoE's experts index their stacked weight once per expert hit."""
    from mapoffload.loading import fp8

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, 128, 128), requires_grad=False)

        def forward(self, x):
            return sum(x @ self.w[e].t() for e in range(4))

    calls = []
    real = fp8.dequantize_fp8
    monkeypatch.setattr(fp8, "dequantize_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = Experts()
    codes, scale = _codes((4, 128, 128)), _scales((4, 1, 1))
    attach_fp8(m, "w", codes, scale, dtype=torch.float32)
    x = torch.randn(2, 128)
    want = sum(x @ real(codes, scale, dtype=torch.float32)[e].t() for e in range(4))
    assert torch.equal(m(x), want) and len(calls) == 1
    assert torch.equal(m(x), want) and len(calls) == 2  # once per forward, not kept between them
    assert m.parametrizations.w[0]._memo is None


def test_the_residency_plan_counts_what_is_read(tmp_path):
    """Under the same page-cache budget an fp8 stack keeps about twice the layers a bf16 one does."""
    from safetensors.torch import save_file

    ref = _fp8_checkpoint(tmp_path / "fp8.safetensors", depth=8)  # bf16 reference holds the dequantized weights
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "bf16.safetensors"))
    plans = {}
    for kind in ("fp8", "bf16"):
        with mapoffload.empty_weights():
            model = Stack(depth=8).to(torch.bfloat16).eval()
        load_checkpoint(model, str(tmp_path / f"{kind}.safetensors"), keep_mapping=True)
        budget = 5 * (2 * 256 * 512 * 2)  # five bf16 layers
        with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=budget) as mgr:
            plans[kind] = mgr.residency
    assert plans["fp8"].layer_bytes[0] * 2 < plans["bf16"].layer_bytes[0] * 1.1
    assert len(plans["fp8"].cached) >= 2 * len(plans["bf16"].cached) > 0, (plans["fp8"], plans["bf16"])



@pytest.mark.parametrize("block", [(128, 128), (16, 32), "channel", "tensor"])
def test_quantize_then_dequantize_is_within_fp8_rounding(block):
    from mapoffload.loading.fp8 import quantize_fp8

    w = torch.randn(256, 384) * 0.05  # whole tiles: transformers derives the block from the grid
    codes, scale = quantize_fp8(w, block)
    assert codes.dtype == E4M3 and codes.shape == w.shape
    back = dequantize_fp8(codes, scale, dtype=torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()  # e4m3: half an ulp, subnormals
    with pytest.raises(ValueError, match="block must be"):
        quantize_fp8(w, "rows")
