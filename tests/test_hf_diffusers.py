"""mapoffload.pipeline_from_pretrained / offload_pipeline on a tiny Flux
pipeline built from real diffusers and transformers classes: the same image as
diffusers' own from_pretrained, every component on the file mapping, the
denoiser's two block lists streamed."""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

import mapoffload  # noqa: E402
from same_kernels import host_weights, seat_like  # noqa: E402

MODELS = ["text_encoder", "text_encoder_2", "transformer", "vae"]


def _tiny_flux():
    import transformers as tf

    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
        latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035)
    clip = tf.CLIPTextModel(tf.CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=100,
        projection_dim=32, max_position_embeddings=77))
    t5 = tf.T5EncoderModel(tf.T5Config(d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4, vocab_size=100))
    # No tokenizers (they need vocabulary files): the prompt is given as embeddings.
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=None,
        text_encoder_2=t5, tokenizer_2=None, transformer=transformer)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pipe = _tiny_flux()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        folder = tmp_path_factory.mktemp(str(dtype).removeprefix("torch."))
        pipe.to(dtype).save_pretrained(folder, max_shard_size="40KB")
        out[dtype] = str(folder)
    return out


def _run(pipe, dtype):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 8, 32, generator=g).to(dtype)
    pooled = torch.randn(1, 32, generator=g).to(dtype)
    with torch.no_grad():
        return pipe(prompt_embeds=prompt, pooled_prompt_embeds=pooled, num_inference_steps=2, height=16, width=16,
                    generator=g, output_type="pt", max_sequence_length=8).images


def _align_like(ref, pipe):
    """Re-seat the reference's weights at the 64-byte offsets of ours
    (tests/same_kernels.py says why): a mapped tensor sits where the safetensors
    file put it (8-byte aligned), a copy where the allocator did; streamed
    weights compute from their host stores on the CPU, so their addresses
    count too."""
    for name in MODELS:
        component = pipe.mapoffload_handle.components.get(name) if pipe.mapoffload_handle else None
        seat_like(getattr(ref, name), host_weights(getattr(pipe, name), component))


def _encoders(pipe):
    ids = torch.tensor([[1, 7, 42, 3, 99, 5]])
    with torch.no_grad():
        return pipe.text_encoder(ids).pooler_output, pipe.text_encoder_2(ids).last_hidden_state


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_image_as_diffusers_all_components_mapped(folders, dtype):
    folder = folders[dtype]
    ref = diffusers.FluxPipeline.from_pretrained(folder, tokenizer=None, tokenizer_2=None, torch_dtype=dtype)
    ref.set_progress_bar_config(disable=True)
    pipe = mapoffload.pipeline_from_pretrained(diffusers.DiffusionPipeline, folder, device="cpu", keep_mapping=True,
                                               tokenizer=None, tokenizer_2=None)
    assert type(pipe) is diffusers.FluxPipeline
    pipe.set_progress_bar_config(disable=True)
    reports, handle = pipe.mapoffload_reports, pipe.mapoffload_handle
    assert sorted(reports) == MODELS
    for name, report in reports.items():
        # Built in the stored dtype: every byte stays on the file mapping.
        assert report.bytes_copied == 0 and report.bytes_mapped > 0, (name, report)
    assert len(reports["transformer"].files) > 1  # sharded
    for name in MODELS:
        assert {p.dtype for p in getattr(ref, name).parameters()} == {dtype}
    # The denoiser's double and single block lists are streamed.
    assert sorted(handle.components["transformer"].managers) == ["single_transformer_blocks", "transformer_blocks"]
    assert "text_encoder_2.encoder.block" in handle.summary()
    # Streamed from the mapping: the very image, once the weights that are
    # not streamed (computed in place on the mapping, 8-byte aligned) sit at
    # the same 64-byte offsets in the reference (see _align_like); without
    # that the image differs in the last bits, from kernel alignment alone.
    image, encoded = _run(pipe, dtype), _encoders(pipe)
    for a, b in zip(_encoders(ref), encoded):
        assert torch.equal(a, b)
    assert torch.allclose(_run(ref, dtype), image, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    _align_like(ref, pipe)
    assert torch.equal(_run(ref, dtype), _run(pipe, dtype))
    handle.close()
    # Mapped weights, whole again: the very image, the kernels' alignment taken out.
    _align_like(ref, pipe)
    weights = [t for name in MODELS for t in getattr(pipe, name).state_dict().values()]
    assert mapoffload.cow_report(weights).anonymous_bytes == 0  # still the mapping, whole again
    assert torch.equal(_run(ref, dtype), _run(pipe, dtype))
    # Copied weights (keep_mapping=False: 64-byte aligned owned memory): the very
    # image diffusers makes from weights at the same 64-byte offsets. diffusers'
    # own load leaves them mapped at the file's offsets (8-byte aligned); on
    # some CPUs (seen on an AMD EPYC) the matmul rounds the last bit by alignment,
    # so the reference is re-seated at the copies' offsets first.
    copied = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, folder, device="cpu", keep_mapping=False,
                                                 tokenizer=None, tokenizer_2=None)
    copied.set_progress_bar_config(disable=True)
    assert all(r.bytes_mapped == 0 and r.bytes_copied > 0 for r in copied.mapoffload_reports.values())
    _align_like(ref, copied)
    assert torch.equal(_run(ref, dtype), _run(copied, dtype))


def test_every_component_stays_mapped_whatever_the_budget(folders, monkeypatch):
    # One rule, as diffusers' and transformers' own loads: mapped unless keep_mapping=False.
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1000")  # copies would fit
    pipe = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, folders[torch.float32], device=None,
                                               tokenizer=None, tokenizer_2=None)
    assert pipe.mapoffload_handle is None
    for name in MODELS:
        report = pipe.mapoffload_reports[name]
        assert report.keep_mapping and report.bytes_copied == 0 and report.bytes_mapped > 0, name


def test_a_cast_component_is_converted_once_into_the_mapping(folders, tmp_path):
    folder = folders[torch.float32]
    dtypes = {"transformer": torch.bfloat16, "text_encoder_2": torch.bfloat16}
    pipe = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, folder, device=None, dtype=dtypes,
                                               tokenizer=None, tokenizer_2=None, cache_dir=str(tmp_path))
    ref = diffusers.FluxPipeline.from_pretrained(folder, tokenizer=None, tokenizer_2=None)
    for name in MODELS:
        report = pipe.mapoffload_reports[name]
        assert report.bytes_copied == 0, (name, report)
        assert (report.converted_tensors > 0) == (name in dtypes), name
        ours = getattr(pipe, name).state_dict()
        assert all(mapoffload.MappedRegions().classify(list(ours.values())))
        for key, t in getattr(ref, name).state_dict().items():  # diffusers' / transformers' own cast, bit for bit
            want = t.to(dtypes[name]) if name in dtypes and t.is_floating_point() else t
            assert torch.equal(ours[key], want), (name, key)
    again = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, folder, device=None, dtype=dtypes,
                                                tokenizer=None, tokenizer_2=None, cache_dir=str(tmp_path))
    assert again.mapoffload_reports["transformer"].conversion_reused


def test_offload_pipeline_built_in_memory_is_exact():
    pipe = _tiny_flux().to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    expected = _run(pipe, torch.float32)
    with mapoffload.offload_pipeline(pipe, device="cpu") as handle:
        assert set(handle.components) == set(MODELS)
        assert "transformer.transformer_blocks" in handle.summary()
        assert torch.equal(expected, _run(pipe, torch.float32))
    assert torch.equal(expected, _run(pipe, torch.float32))


def test_unet_streams_down_and_up_blocks():
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, norm_num_groups=8, attention_head_dim=2).eval()
    sample, t, ctx = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 3, 16)
    with torch.no_grad():
        expected = unet(sample, t, ctx).sample

    class Pipe:
        components = {"unet": unet}

    with mapoffload.offload_pipeline(Pipe(), device="cpu") as handle:
        assert sorted(handle.components["unet"].managers) == ["down_blocks", "up_blocks"]
        with torch.no_grad():
            assert torch.equal(expected, unet(sample, t, ctx).sample)


def test_not_a_pipeline_folder_and_missing_extra(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, tmp_path, device=None)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    with pytest.raises(ValueError, match="NoSuchPipeline"):
        mapoffload.pipeline_from_pretrained(diffusers.DiffusionPipeline, tmp_path, device=None)
    from mapoffload.hf import MissingExtraError

    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(MissingExtraError, match=r'pip install "\.\[diffusers\]" in the mapoffload source tree'):
        mapoffload.pipeline_from_pretrained(object, tmp_path, device=None)


def test_the_pipeline_handle_attribute_names_the_live_handle():
    """``pipe.mapoffload_handle`` (and each component's) while the offload is open; close() sets them to None."""
    pipe = _tiny_flux()
    handle = mapoffload.offload_pipeline(pipe, device="cpu")
    assert pipe.mapoffload_handle is handle
    assert pipe.transformer.mapoffload_handle is handle.components["transformer"]
    handle.close()
    assert pipe.mapoffload_handle is None and pipe.transformer.mapoffload_handle is None


def test_one_handle_type_for_a_model_and_a_pipeline():
    """Every entry point returns :class:`mapoffload.OffloadHandle` (issue 42: a pipeline had a class of
    its own); a pipeline's holds one per component, and closing it closes them all."""
    import mapoffload
    from mapoffload.hf.offload import OffloadHandle

    assert not hasattr(mapoffload.hf, "PipelineOffloadHandle")

    class Pipe:
        def __init__(self):
            self.components = {"text_encoder": torch.nn.Sequential(torch.nn.Linear(4, 4)), "scheduler": object()}

    pipe = Pipe()
    handle = mapoffload.offload_pipeline(pipe, device="cpu")
    assert type(handle) is OffloadHandle and pipe.mapoffload_handle is handle
    assert list(handle.components) == ["text_encoder"] and type(handle.components["text_encoder"]) is OffloadHandle
    assert {row.component for row in handle.rows} == {"text_encoder"}
    handle.close()
    assert pipe.mapoffload_handle is None and handle.components["text_encoder"].rows == []
    assert "closed" in handle.summary()


def test_a_diffusers_conversion_the_model_takes_otherwise_is_converted_again(folders, tmp_path, monkeypatch):
    """The net under the key (as for transformers, tests/test_conversion_code.py): a reused conversion whose
    tensors the component takes in another dtype or shape is discarded and converted again, once."""
    from mapoffload.hf import _drive_diffusers

    folder = folders[torch.float32]
    dtypes = {"transformer": torch.bfloat16, "text_encoder_2": torch.bfloat16}

    def load():
        return mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, folder, device=None, dtype=dtypes,
                                                   tokenizer=None, tokenizer_2=None, cache_dir=str(tmp_path))

    load()
    real, calls = _drive_diffusers.stale_tensors, []

    def stale_once(model, reused):  # the transformer's first reused load: it took one tensor otherwise
        if isinstance(model, diffusers.FluxTransformer2DModel):
            calls.append(bool(reused))
            if calls == [True]:
                return ["x.weight: stored torch.bfloat16 (2,), the model's torch.float32 (2,)"]
        return real(model, reused)

    monkeypatch.setattr(_drive_diffusers, "stale_tensors", stale_once)
    again = load()
    assert not again.mapoffload_reports["transformer"].conversion_reused  # converted again
    assert calls[0] and not any(calls[calls.index(False):])  # a stale shard; then the load that wrote anew
    assert load().mapoffload_reports["transformer"].conversion_reused
