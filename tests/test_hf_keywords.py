"""Keywords of from_pretrained and pipeline_from_pretrained (issue 36): a config
field goes to the config, as transformers sends it (the same config, the same
logits as ``cls.from_pretrained(folder, field=...)``); a misspelt mapoffload
keyword is named with the one meant; anything else is refused by name before
the model is built. One device rule for the Python entry points and the demo;
and a pipeline's ``keep_mapping=None`` weighs the whole pipeline once."""

from __future__ import annotations

import logging
import warnings

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import mapoffload  # noqa: E402
import mapoffload.hf  # noqa: E402
from hf_models import save  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 33, 2, 70]])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save("llama", torch.float32, folder)
    return str(folder)


@pytest.fixture
def builds(monkeypatch):
    """Counts models built by transformers: a refused call must refuse before building one."""
    import transformers as tf

    calls = []
    real = tf.LlamaForCausalLM.__init__

    def counting(self, *args, **kwargs):
        calls.append(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(tf.LlamaForCausalLM, "__init__", counting)
    return calls


def _config_values(config):
    data = config.to_dict()
    data.pop("_name_or_path", None)
    return data


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("fields", [{"rms_norm_eps": 1e-3}, {"num_hidden_layers": 1},
                                    {"rms_norm_eps": 1e-2, "attn_implementation": "eager"}])
@pytest.mark.parametrize("auto", [False, True])
def test_config_fields_go_to_the_config_as_transformers_sends_them(llama, fields, auto):
    import transformers as tf

    cls = tf.AutoModelForCausalLM if auto else tf.LlamaForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_hidden_layers=1: the second layer's weights are unexpected, in both
        ref = cls.from_pretrained(llama, **fields).eval()
        ours = mapoffload.from_pretrained(cls, llama, device=None, **fields)
    for name, value in fields.items():
        if name != "attn_implementation":
            assert getattr(ours.config, name) == value
    assert ours.config._attn_implementation == ref.config._attn_implementation
    assert _config_values(ours.config) == _config_values(ref.config)
    assert len(ours.model.layers) == len(ref.model.layers)
    assert torch.equal(_logits(ours), _logits(ref))


def test_config_fields_offloaded_compute_what_transformers_computes(llama):
    import transformers as tf

    ref = tf.LlamaForCausalLM.from_pretrained(llama, rms_norm_eps=1e-3).eval()
    ours = mapoffload.from_pretrained(tf.LlamaForCausalLM, llama, device="cpu", rms_norm_eps=1e-3)
    try:
        assert ours.config.rms_norm_eps == 1e-3
        assert torch.allclose(_logits(ours), _logits(ref), rtol=0, atol=1e-6)
    finally:
        ours.mapoffload_handle.close()


def test_a_config_field_beside_an_explicit_config_is_refused_by_name(llama, builds):
    import transformers as tf

    config = tf.LlamaConfig.from_pretrained(llama)
    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained(tf.LlamaForCausalLM, llama, device=None, config=config, rms_norm_eps=1e-3)
    text = str(exc.value)
    assert "\n" not in text and "rms_norm_eps=" in text and "config.rms_norm_eps" in text, text
    assert not builds


@pytest.mark.parametrize("kwargs, typo, meant", [
    ({"devcie": "cpu"}, "devcie", "device"),
    ({"device": "cpu", "prefech_layers": 2}, "prefech_layers", "prefetch_layers"),
    ({"device": None, "keep_maping": False}, "keep_maping", "keep_mapping"),
    ({"device": None, "attn_implmentation": "eager"}, "attn_implmentation", "attn_implementation"),
    ({"device": None, "rms_norm_epsilon": 1e-3}, "rms_norm_epsilon", "rms_norm_eps"),
])
def test_a_misspelt_keyword_is_named_with_the_one_meant(llama, builds, kwargs, typo, meant):
    import transformers as tf

    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained(tf.LlamaForCausalLM, llama, **kwargs)
    text = str(exc.value)
    assert "\n" not in text, text
    assert f"{typo!r}" in text and f"did you mean {meant}=?" in text, text
    assert "__init__" not in text
    assert not builds


def test_a_keyword_nobody_takes_is_refused_by_name_before_the_model_is_built(llama, builds):
    import transformers as tf

    for cls in (tf.LlamaForCausalLM, tf.AutoModelForCausalLM):
        with pytest.raises(TypeError) as exc:
            mapoffload.from_pretrained(cls, llama, device=None, frobnicate=3)
        text = str(exc.value)
        assert "\n" not in text and "'frobnicate'" in text and "LlamaConfig" in text, text
        assert "did you mean" not in text
    with pytest.raises(TypeError, match="'frobnicate'"):
        mapoffload.hf.load_pretrained(tf.LlamaForCausalLM, llama, frobnicate=3)
    assert not builds


def test_transformers_own_keywords_still_reach_it(llama):
    import transformers as tf

    model = mapoffload.from_pretrained(tf.LlamaForCausalLM, llama, device=None, attn_implementation="eager",
                                       trust_remote_code=False, use_safetensors=True)
    assert model.config._attn_implementation == "eager"


# --- one device rule ------------------------------------------------------------------


@pytest.fixture
def one_gpu(monkeypatch):
    """torch made to see one CUDA device (nothing is put on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_the_entry_points_and_the_demo_apply_one_device_rule(one_gpu):
    from mapoffload.cli.demo import resolve_device
    from mapoffload._checks import check_device

    assert check_device("cuda:0") == torch.device("cuda:0") == resolve_device("cuda:0")
    assert check_device("cpu") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ValueError, match=r"device='cuda:3', but torch sees 1 CUDA device\(s\), cuda:0 to cuda:0"):
        check_device("cuda:3")
    with pytest.raises(ValueError, match=r"^--device cuda:3: torch sees 1 CUDA device\(s\), cuda:0 to cuda:0"):
        resolve_device("cuda:3")


def test_a_cuda_device_torch_does_not_see_is_refused_alike(monkeypatch):
    from mapoffload.cli.demo import resolve_device
    from mapoffload._checks import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call in (check_device, resolve_device):
        with pytest.raises(ValueError, match="torch sees no CUDA device") as exc:
            call("cuda")
        assert isinstance(exc.value, RuntimeError)  # what from_pretrained raised for it
    for bad in ("gpu", "meta"):
        for call in (check_device, resolve_device):
            with pytest.raises(ValueError):
                call(bad)


# --- pipelines ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    pytest.importorskip("diffusers")
    from test_hf_diffusers import _tiny_flux

    folder = tmp_path_factory.mktemp("flux")
    _tiny_flux().save_pretrained(folder)
    return str(folder)


@pytest.fixture
def pipeline_loads(monkeypatch):
    """Counts component loads: a refused call must refuse before loading one."""
    import mapoffload.hf.diffusers as hfd

    calls = []
    for name in ("_load_diffusers_model", "_load_component"):
        real = getattr(hfd, name, None)
        if real is None:
            continue

        def counting(*args, _real=real, **kwargs):
            calls.append(args)
            return _real(*args, **kwargs)

        monkeypatch.setattr(hfd, name, counting)
    return calls


@pytest.mark.parametrize("kwargs, typo, meant", [
    ({"devcie": "cpu"}, "devcie", "device"),
    ({"device": "cpu", "prefech_layers": 2}, "prefech_layers", "prefetch_layers"),
    ({"device": None, "keep_maping": False}, "keep_maping", "keep_mapping"),
    ({"device": None, "text_encoder2": None}, "text_encoder2", "text_encoder_2"),
])
def test_a_misspelt_pipeline_keyword_is_named_with_the_one_meant(flux, pipeline_loads, kwargs, typo, meant):
    import diffusers

    with pytest.raises(TypeError) as exc:
        mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, flux, tokenizer=None, tokenizer_2=None, **kwargs)
    text = str(exc.value)
    assert "\n" not in text and f"{typo!r}" in text and f"did you mean {meant}=?" in text, text
    assert not pipeline_loads


def test_a_pipeline_keyword_nobody_takes_is_refused_by_name(flux, pipeline_loads):
    import diffusers

    with pytest.raises(TypeError) as exc:
        mapoffload.pipeline_from_pretrained(diffusers.DiffusionPipeline, flux, device=None, tokenizer=None,
                                            tokenizer_2=None, frobnicate=1)
    text = str(exc.value)
    assert "\n" not in text and "'frobnicate'" in text and "FluxPipeline" in text, text
    with pytest.raises(TypeError, match=r"torch_dtype=: pass dtype="):
        mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, flux, device=None, torch_dtype=torch.float32)
    assert not pipeline_loads


def _component_bytes(flux):
    import diffusers

    pipe = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, flux, device=None, tokenizer=None,
                                               tokenizer_2=None)
    return {name: r.bytes_mapped for name, r in pipe.mapoffload_reports.items()}


def _gate_lines(caplog):
    return [r for r in caplog.records if r.name == "mapoffload" and "copies would take" in r.getMessage()]


def test_a_pipeline_gate_weighs_the_whole_pipeline_once(flux, monkeypatch, caplog):
    import diffusers

    import mapoffload.loading.gate as gate
    from mapoffload.memory.budget import HOST_COPY_RESERVE_BYTES

    sizes = _component_bytes(flux)
    largest, total = max(sizes.values()), sum(sizes.values())
    assert largest < total
    # Each component alone would fit; the pipeline does not.
    monkeypatch.setattr(gate, "host_memory_available_bytes",
                        lambda: HOST_COPY_RESERVE_BYTES + (largest + total) // 2)
    caplog.set_level(logging.INFO, logger="mapoffload")
    pipe = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, flux, device=None, keep_mapping=None,
                                               tokenizer=None, tokenizer_2=None)
    assert len(_gate_lines(caplog)) == 1, [r.getMessage() for r in _gate_lines(caplog)]
    assert "copies would not fit" in _gate_lines(caplog)[0].getMessage()
    for name, report in pipe.mapoffload_reports.items():
        assert report.decided_by == "gate" and report.keep_mapping, (name, report)
        assert report.bytes_copied == 0 and report.bytes_mapped == sizes[name], (name, report)
        assert all(mapoffload.MappedRegions().classify(list(getattr(pipe, name).parameters()))), name


def test_a_pipeline_that_fits_is_copied_on_one_decision(flux, monkeypatch, caplog):
    import diffusers

    import mapoffload.loading.gate as gate
    from mapoffload.memory.budget import HOST_COPY_RESERVE_BYTES

    sizes = _component_bytes(flux)
    monkeypatch.setattr(gate, "host_memory_available_bytes",
                        lambda: HOST_COPY_RESERVE_BYTES + 2 * sum(sizes.values()))
    caplog.set_level(logging.INFO, logger="mapoffload")
    pipe = mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, flux, device=None, keep_mapping=None,
                                               tokenizer=None, tokenizer_2=None)
    assert len(_gate_lines(caplog)) == 1
    for name, report in pipe.mapoffload_reports.items():
        assert report.decided_by == "gate" and not report.keep_mapping, (name, report)
        assert report.bytes_mapped == 0 and report.copied.get("copies fit (gate)") == sizes[name], (name, report)


def test_a_single_model_gate_still_weighs_the_model(llama, monkeypatch, caplog):
    import transformers as tf

    import mapoffload.loading.gate as gate
    from mapoffload.memory.budget import HOST_COPY_RESERVE_BYTES

    mapped = mapoffload.from_pretrained(tf.LlamaForCausalLM, llama, device=None).mapoffload_report.bytes_mapped
    for room, keeps in ((mapped - 1, True), (mapped + 1, False)):
        monkeypatch.setattr(gate, "host_memory_available_bytes", lambda room=room: HOST_COPY_RESERVE_BYTES + room)
        report = mapoffload.from_pretrained(tf.LlamaForCausalLM, llama, device=None,
                                            keep_mapping=None).mapoffload_report
        assert report.decided_by == "gate" and report.keep_mapping == keeps
