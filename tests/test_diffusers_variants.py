"""A diffusers component folder holding other variants beside its main
checkpoint (``diffusion_pytorch_model.fp32.safetensors``, a legacy sharded
``fp16`` variant with its own index): mapoffload reads what diffusers reads,
the main checkpoint, for the stored dtype, the conversion's key and the bytes
reported; the variants are never read."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

import mapoffload  # noqa: E402
from mapoffload.hf.diffusers import load_pipeline  # noqa: E402
from mapoffload.loading.files import diffusers_files  # noqa: E402
from test_hf_diffusers import _tiny_flux  # noqa: E402

NO_TOKENIZERS = {"tokenizer": None, "tokenizer_2": None}


@pytest.fixture(scope="module")
def pipe_bf16():
    return _tiny_flux().to(torch.bfloat16)


def _save(pipe, folder, **transformer_variants):
    pipe.save_pretrained(folder)
    sub = os.path.join(folder, "transformer")
    for variant, (dtype, shard) in transformer_variants.items():
        pipe.transformer.to(dtype).save_pretrained(sub, variant=variant, max_shard_size=shard)
    pipe.transformer.to(torch.bfloat16)
    return sub


def _same_as_diffusers(folder):
    ref = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16, **NO_TOKENIZERS).transformer
    ours, reports = load_pipeline(diffusers.FluxPipeline, folder, **NO_TOKENIZERS)
    assert ours.transformer.dtype == torch.bfloat16
    mine = ours.transformer.state_dict()
    for name, t in ref.state_dict().items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name
    return reports["transformer"]


@pytest.mark.parametrize("extra", ["diffusion_pytorch_model.fp32.safetensors", "diffusion_pytorch_model_ema.safetensors"])
def test_another_file_in_another_dtype_decides_nothing(tmp_path, pipe_bf16, extra):
    """A variant sorting before the main file, or a file sorting after it (a training run's EMA
    weights): neither is read. The one after took the "auto" dtype (float32) before."""
    sub = _save(pipe_bf16, tmp_path, fp32=(torch.float32, "10GB"))
    os.rename(os.path.join(sub, "diffusion_pytorch_model.fp32.safetensors"), os.path.join(sub, extra))
    main = os.path.join(sub, "diffusion_pytorch_model.safetensors")
    assert diffusers_files(sub) == [main]
    report = _same_as_diffusers(tmp_path)
    assert report.bytes_copied == 0  # stored bf16 kept mapped: the fp32 variant did not make "auto" a cast
    assert report.bytes_mapped <= os.path.getsize(main)


def test_a_legacy_sharded_variant_beside_the_main_index(tmp_path, pipe_bf16):
    pipe_bf16.save_pretrained(tmp_path, max_shard_size="100KB")
    sub = os.path.join(tmp_path, "transformer")
    pipe_bf16.transformer.to(torch.float16).save_pretrained(sub, variant="fp16", max_shard_size="100KB")
    pipe_bf16.transformer.to(torch.bfloat16)
    legacy = os.path.join(sub, "diffusion_pytorch_model.fp16.safetensors.index.json")
    os.rename(os.path.join(sub, "diffusion_pytorch_model.safetensors.index.fp16.json"), legacy)
    with pytest.raises(mapoffload.CheckpointError, match="2 safetensors indexes"):
        mapoffload.checkpoint_files(sub)  # the general rule asks which one
    files = diffusers_files(sub)
    assert len(files) > 1 and not any(".fp16" in os.path.basename(f) for f in files)
    _same_as_diffusers(tmp_path)


def test_no_file_diffusers_reads(tmp_path):
    (tmp_path / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model.safetensors .*diffusers"):
        diffusers_files(tmp_path)
