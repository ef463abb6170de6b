"""The scales of an fp8 checkpoint: every scale dtype transformers decodes is
decoded as it does (bit for bit, against transformers' own dequantization), an
other dtype is refused by name, and a scale grid that does not fit its codes in
every dimension is refused with the key and both shapes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from mapoffload import CheckpointError, load_checkpoint  # noqa: E402
from mapoffload.loading.fp8 import attach_fp8, dequantize_fp8  # noqa: E402

from fp8_models import random_codes as _codes, transformers_dequant as _transformers_dequant  # noqa: E402

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _e8m0(shape, seed=1):
    """E8M0 exponents as bytes, around 2**-10 (MXFP8 checkpoints store them as uint8)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(110, 125, shape, generator=g, dtype=torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,grid", [((256, 384), (2, 3)), ((4, 256, 128), (4, 2, 1))])
def test_uint8_scales_are_e8m0_exponents_as_transformers_decodes_them(shape, grid, dtype):
    codes, scale = _codes(shape), _e8m0(grid)
    want = _transformers_dequant(codes, scale, dtype)
    got = dequantize_fp8(codes, scale, dtype=dtype)
    assert _same_bits(got, want)
    # An independent reading of the rule: 2 ** (byte - 127), the byte never a plain multiplier.
    first = float(codes.reshape(-1)[0].float()) * 2.0 ** (int(scale.reshape(-1)[0]) - 127)
    assert float(got.reshape(-1)[0].float()) == pytest.approx(first, rel=1e-2)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="this torch has no float8_e8m0fnu")
def test_float8_e8m0fnu_scales_are_decoded_as_transformers_does():
    codes, scale = _codes((256, 256)), _e8m0((2, 2)).view(torch.float8_e8m0fnu)
    assert _same_bits(dequantize_fp8(codes, scale, dtype=torch.bfloat16),
                      _transformers_dequant(codes, scale, torch.bfloat16))


@pytest.mark.parametrize("bad", [torch.int8, torch.int32, torch.int64, torch.bool])
def test_a_scale_dtype_transformers_does_not_decode_is_refused_by_name(bad):
    codes = _codes((128, 128))
    with pytest.raises(TypeError, match=str(bad).removeprefix("torch.")):
        dequantize_fp8(codes, torch.ones(1, 1, dtype=bad), dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match="up.weight.*" + str(bad).removeprefix("torch.")):
        _attach_named(codes, torch.ones(1, 1, dtype=bad))


def _attach_named(codes, scale):
    module = torch.nn.Module()
    module.up = torch.nn.Linear(codes.shape[-1], codes.shape[-2], bias=False)
    attach_fp8(module.up, "weight", codes, scale, dtype=torch.bfloat16, key="up.weight")


@pytest.mark.parametrize("codes_shape,grid,theirs_raise", [
    ((4, 256, 128), (3, 2, 1), True),       # 3 expert grids for 4 experts: transformers' formula raises
    ((4, 256, 128), (8, 2, 1), True),       # more grids than experts
    ((128, 128), (2, 1, 1), True),          # grids for experts a 2-D weight does not have
    ((2, 3, 128, 256), (3, 2, 1, 2), False),  # leading dims swapped: transformers' reshape(-1) pairs them anyway
])
def test_a_scale_grid_whose_leading_dims_differ_is_refused_with_both_shapes(codes_shape, grid, theirs_raise):
    codes, scale = _codes(codes_shape), torch.rand(grid) * 1e-3
    with pytest.raises(ValueError) as plain:
        dequantize_fp8(codes, scale, dtype=torch.bfloat16)
    if theirs_raise:  # transformers' own formula refuses these too
        with pytest.raises((ValueError, RuntimeError)):
            _transformers_dequant(codes, scale, torch.bfloat16)
    with pytest.raises(CheckpointError) as named:
        _attach_named(codes, scale)
    assert str(named.value).startswith("up.weight: ")
    for message in (str(plain.value), str(named.value)):
        assert str(tuple(codes_shape)) in message and str(tuple(grid)) in message, message


@pytest.mark.parametrize("codes_shape,grid", [
    ((4, 256, 128), (2, 1)),         # one grid shared by the experts
    ((4, 256, 128), (1, 2, 1)),      # the same, with a leading 1
    ((2, 3, 128, 256), (2, 3, 1, 2)),
])
def test_grids_transformers_accepts_still_load(codes_shape, grid):
    codes, scale = _codes(codes_shape), torch.rand(grid) * 1e-3
    assert _same_bits(dequantize_fp8(codes, scale, dtype=torch.bfloat16),
                      _transformers_dequant(codes, scale, torch.bfloat16))


class Up(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.up(x)


def test_load_checkpoint_decodes_e8m0_scales_as_transformers(tmp_path):
    from safetensors.torch import save_file

    codes, scale = _codes((256, 256)), _e8m0((2, 2))
    save_file({"up.weight": codes, "up.weight_scale_inv": scale}, str(tmp_path / "m.safetensors"))
    with mapoffload.empty_weights():
        model = Up().to(torch.bfloat16)
    report = load_checkpoint(model, str(tmp_path / "m.safetensors"), keep_mapping=True)
    assert report.fp8_weights == 1 and report.bytes_copied == 0
    want = _transformers_dequant(codes, scale, torch.bfloat16)
    with torch.no_grad():
        assert _same_bits(model.up.weight, want)
        # Codes up to 448 times 2 ** (124 - 127) at most; a byte used as a multiplier gave thousands.
        assert float(model.up.weight.abs().max()) <= 448 * 2.0 ** -3


def test_load_checkpoint_refuses_a_scale_dtype_by_key(tmp_path):
    from safetensors.torch import save_file

    save_file({"up.weight": _codes((256, 256)), "up.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)},
              str(tmp_path / "m.safetensors"))
    with mapoffload.empty_weights():
        model = Up().to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: up\.weight_scale_inv.*int32"):
        load_checkpoint(model, str(tmp_path / "m.safetensors"), keep_mapping=True)


def test_load_checkpoint_refuses_a_grid_with_other_leading_dims(tmp_path):
    from safetensors.torch import save_file

    save_file({"up.weight": _codes((256, 256)), "up.weight_scale_inv": torch.rand(3, 2, 2)},
              str(tmp_path / "m.safetensors"))
    with mapoffload.empty_weights():
        model = Up().to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: up\.weight_scale_inv") as info:
        load_checkpoint(model, str(tmp_path / "m.safetensors"), keep_mapping=True)
    assert "(256, 256)" in str(info.value) and "(3, 2, 2)" in str(info.value)
