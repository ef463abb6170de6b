"""The mistakes a newcomer makes with from_pretrained, offload and
pipeline_from_pretrained: each gets one line naming what is wrong and the
fix, before anything is loaded - never a raw AttributeError from deep inside,
nor advice that does not apply."""

from __future__ import annotations

import inspect
import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import mapoffload  # noqa: E402
from conformance_zoo import build  # noqa: E402


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    build("gpt2", str(folder))
    return folder


@pytest.fixture
def loads(monkeypatch):
    """Counts transformers' loads: a refused call must refuse before loading."""
    import transformers as tf

    calls = []
    real = tf.GPT2LMHeadModel.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        calls.append(args)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(tf.GPT2LMHeadModel, "from_pretrained", classmethod(counting))
    return calls


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("layers", [5, 2.5, True, [5]])
def test_layers_as_a_count_says_what_layers_takes(gpt2, loads, layers):
    import transformers as tf

    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cpu", layers=layers)
    text = _one_line(exc)
    assert f"layers={layers!r}" in text and "which block lists to stream" in text and "prefetch_layers=" in text
    assert not loads


def test_offload_with_layers_as_a_count_says_what_layers_takes(gpt2):
    import transformers as tf

    model = tf.GPT2LMHeadModel.from_pretrained(gpt2).eval()
    with pytest.raises(TypeError, match=r"layers=5: layers names which block lists to stream"):
        mapoffload.offload(model, device="cpu", layers=5)
    assert not any(isinstance(p, mapoffload.OffloadedWeight) for p in model.parameters())


def test_the_class_as_a_string_names_the_class_to_pass(gpt2):
    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained("GPT2LMHeadModel", gpt2, device="cpu")
    assert _one_line(exc) == ("mapoffload.from_pretrained takes a model class, not the string 'GPT2LMHeadModel': "
                              "pass transformers.GPT2LMHeadModel")


def test_a_built_model_config_class_or_plain_module_is_not_a_model_class(gpt2):
    import transformers as tf

    model = tf.GPT2LMHeadModel.from_pretrained(gpt2)
    with pytest.raises(TypeError, match=r"not a built GPT2LMHeadModel: pass its class .* or stream this one with "
                                        r"mapoffload.offload\(model, device=\.\.\.\)"):
        mapoffload.from_pretrained(model, gpt2, device="cpu")
    with pytest.raises(TypeError, match=r"GPT2Config is a configuration class: pass a model class"):
        mapoffload.from_pretrained(tf.GPT2Config, gpt2, device="cpu")
    with pytest.raises(TypeError, match=r"torch.nn.modules.linear.Linear is not a transformers model class.*"
                                        r"load_checkpoint"):
        mapoffload.from_pretrained(torch.nn.Linear, gpt2, device="cpu")


def test_a_file_instead_of_its_folder_names_the_folder(gpt2):
    import transformers as tf

    path = gpt2 / "model.safetensors"
    with pytest.raises(ValueError) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, path, device="cpu")
    text = _one_line(exc)
    assert text == (f"{str(path)!r} is a file: mapoffload.from_pretrained takes the folder save_pretrained wrote "
                    f"(config.json beside the weights): pass {str(gpt2)!r}")
    assert "download" not in text


def test_a_missing_local_folder_is_missing_and_a_hub_id_is_one(tmp_path):
    import transformers as tf

    with pytest.raises(FileNotFoundError) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, tmp_path / "nope", device="cpu")
    assert _one_line(exc) == f"no such folder: {tmp_path / 'nope'}"
    with pytest.raises(FileNotFoundError, match=r"'openai-community/gpt2' is not a local folder and looks like a "
                                                r"hub id: .*download it first"):
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, "openai-community/gpt2", device="cpu")
    with pytest.raises(TypeError, match=r"folder must be a path \(str or os.PathLike\), not NoneType"):
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, None, device="cpu")


def test_quantization_config_is_refused_before_transformers_sees_it(gpt2, loads):
    import transformers as tf

    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cpu", quantization_config={"quant_method": "awq"})
    text = _one_line(exc)
    assert text.startswith("mapoffload.from_pretrained does not take quantization_config=:")
    assert "config.json" in text and "fp8=" in text
    assert not loads


def test_a_dtype_change_of_an_offloaded_model_says_how_to_get_that_dtype(gpt2):
    import transformers as tf

    model = mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cpu")
    for convert in (lambda m: m.to(torch.float16), lambda m: m.half(), lambda m: m.to(dtype=torch.float16)):
        with pytest.raises(TypeError) as exc:
            convert(model)
        text = _one_line(exc)
        assert "dtype=torch.float16" in text and "model.mapoffload_handle.close()" in text, text
        assert "prefetch_layer" not in text and "register_forward_hooks" not in text
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # nothing converted
    model.mapoffload_handle.close()
    assert model.half().transformer.h[0].attn.c_attn.weight.dtype == torch.float16


@pytest.mark.cuda
def test_the_placeholder_error_names_the_call_the_user_has(gpt2):
    import transformers as tf

    model = mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cuda")
    weight = model.transformer.h[0].attn.c_attn.weight
    with pytest.raises(RuntimeError) as exc:
        weight.sum()
    text = _one_line(exc)
    assert "model.mapoffload_handle.close()" in text and "LayerwiseOffloadManager" not in text, text
    model.mapoffload_handle.close()
    built = tf.GPT2LMHeadModel.from_pretrained(gpt2).eval()
    with mapoffload.offload(built, device="cuda"):
        with pytest.raises(RuntimeError, match=r"handle\.close\(\)"):
            built.transformer.h[1].mlp.c_fc.weight.sum()


def test_in_place_there_is_no_placeholder_to_refuse_a_read(gpt2):
    """On the CPU the weights are read where they are; a conversion still names the user's call."""
    import transformers as tf

    ref = tf.GPT2LMHeadModel.from_pretrained(gpt2).eval()
    model = mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cpu")
    weight = model.transformer.h[0].attn.c_attn.weight
    assert not isinstance(weight, mapoffload.OffloadedWeight)
    assert torch.equal(weight, ref.transformer.h[0].attn.c_attn.weight)
    with pytest.raises(TypeError, match=r"model\.mapoffload_handle\.close\(\)"):
        model.half()
    model.mapoffload_handle.close()


def test_device_is_a_required_keyword_of_every_entry_point():
    from mapoffload.hf import offload_pipeline

    for fn in (mapoffload.from_pretrained, mapoffload.offload, mapoffload.pipeline_from_pretrained,
               offload_pipeline):
        param = inspect.signature(fn).parameters["device"]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is inspect.Parameter.empty, fn


def test_device_is_required_by_every_entry_point(tmp_path):
    # No device and no options: refused before anything is read, naming device= (the folder need not exist).
    calls = [lambda: mapoffload.from_pretrained(object, tmp_path),
             lambda: mapoffload.pipeline_from_pretrained(object, tmp_path),
             lambda: mapoffload.offload(torch.nn.Linear(2, 2)),
             lambda: mapoffload.offload_pipeline(object()),
             lambda: mapoffload.LayerwiseOffloadManager(torch.nn.Sequential(), "0")]
    for call in calls:
        with pytest.raises(TypeError, match=r"needs (a device|device=)"):
            call()


def test_offload_devices_it_cannot_use_are_named(gpt2):
    import transformers as tf

    model = tf.GPT2LMHeadModel.from_pretrained(gpt2).eval()
    with pytest.raises(TypeError, match=r"offload needs a device: device='cuda', 'cuda:N' or 'cpu' \(device=None, "
                                        r"no offload, is for from_pretrained"):
        mapoffload.offload(model, device=None)
    with pytest.raises(ValueError, match=r"device must be 'cuda', 'cuda:N' or 'cpu', not 'gpu'"):
        mapoffload.offload(model, device="gpu")
    with pytest.raises(ValueError, match=r"device must be 'cuda', 'cuda:N' or 'cpu', not 'gpu'"):
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"device='cuda', but torch sees no CUDA device"):
            mapoffload.offload(model, device="cuda")
    with pytest.raises(TypeError, match=r"offload takes a built torch.nn.Module, not str"):
        mapoffload.offload("gpt2", device="cpu")
    assert not any(isinstance(p, mapoffload.OffloadedWeight) for p in model.parameters())


@pytest.mark.parametrize("kwargs, error, says", [
    ({"prefetch_layers": "2"}, TypeError, "prefetch_layers must be a whole number >= 0, not '2'"),
    ({"prefetch_layers": -1}, ValueError, "prefetch_layers must be a whole number >= 0, not -1"),
    ({"rest": "gpu"}, ValueError, "rest must be one of ('auto', 'device', 'stream'), not 'gpu'"),
    ({"host_store": "disk"}, ValueError, "host_store must be one of"),
    ({"reads": "fast"}, ValueError, "reads must be one of"),
])
def test_offload_arguments_are_checked_before_loading(gpt2, loads, kwargs, error, says):
    import transformers as tf

    with pytest.raises(error) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cpu", **kwargs)
    assert says in _one_line(exc)
    assert not loads


def test_pipeline_from_pretrained_mistakes(gpt2, tmp_path):
    diffusers = pytest.importorskip("diffusers")

    with pytest.raises(TypeError, match=r"takes a pipeline class, not the string 'FluxPipeline': pass "
                                        r"diffusers.FluxPipeline"):
        mapoffload.pipeline_from_pretrained("FluxPipeline", tmp_path, device="cpu")
    index = tmp_path / "model_index.json"
    index.write_text("{}")
    with pytest.raises(ValueError, match=rf"{str(index)!r} is a file: mapoffload.pipeline_from_pretrained takes "
                                         rf"the folder save_pretrained wrote \(model_index.json beside the "
                                         rf"component folders\): pass {str(tmp_path)!r}"):
        mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, index, device="cpu")
    with pytest.raises(FileNotFoundError, match=r"a transformers model folder \(config.json\): load it with "
                                                r"mapoffload.from_pretrained"):
        mapoffload.pipeline_from_pretrained(diffusers.FluxPipeline, gpt2, device="cpu")
    assert os.path.isdir(gpt2)


@pytest.fixture
def never_loads(monkeypatch):
    """transformers' load made to fail loudly: a refusal must come before it (a wrong
    class would otherwise build a default-sized model - a 7B Llama - and be OOM-killed)."""
    import transformers as tf

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained was reached")

    for cls in (tf.LlamaForCausalLM, tf.GPT2LMHeadModel):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))


def test_a_model_class_for_another_architecture_is_refused_before_loading(gpt2, never_loads):
    import transformers as tf

    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained(tf.LlamaForCausalLM, gpt2, device="cpu")
    text = _one_line(exc)
    assert text.startswith(f"LlamaForCausalLM is a 'llama' model class, and {gpt2}/config.json describes a 'gpt2' "
                           "model:"), text
    assert "AutoModelForCausalLM" in text and "config=" in text


def test_a_folder_without_config_json_is_refused_before_loading(gpt2, never_loads, tmp_path):
    import shutil

    import transformers as tf

    shutil.copy(gpt2 / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, tmp_path, device="cpu")
    assert _one_line(exc) == (f"no config.json in {tmp_path}: mapoffload.from_pretrained takes the folder "
                              "save_pretrained wrote (config.json beside the weights), or config= for one without")


@pytest.mark.parametrize("kwargs, says", [
    ({"keep_mapping": "false"}, "keep_mapping must be True, False or None (the gate), not 'false'"),
    ({"keep_mapping": 0}, "keep_mapping must be True, False or None (the gate), not 0"),
    ({"strict": "no"}, "strict must be True or False, not 'no'"),
])
def test_flags_given_as_strings_are_refused_not_read_as_true(gpt2, loads, kwargs, says):
    # keep_mapping="false" kept the mapping (any string but False did): the opposite of what was asked.
    import transformers as tf

    with pytest.raises(TypeError) as exc:
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device="cpu", **kwargs)
    assert _one_line(exc) == says
    assert not loads


def test_auto_config_is_a_configuration_class(gpt2):
    import transformers as tf

    with pytest.raises(TypeError, match=r"^AutoConfig is a configuration class: pass a model class"):
        mapoffload.from_pretrained(tf.AutoConfig, gpt2, device=None)


def test_an_empty_cache_dir_is_refused_before_loading(gpt2, loads):
    """``cache_dir=""`` loaded the whole model, then failed "creating a conversion folder under : ..."."""
    import transformers as tf

    with pytest.raises(ValueError, match="cache_dir is empty"):
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, gpt2, device=None, dtype=torch.float16, cache_dir="")
    assert loads == []
