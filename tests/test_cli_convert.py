"""`mapoffload convert`'s refusals, checked before anything loads: a missing path vs a hub id, a
file, a diffusers pipeline or model folder, a dtype or class name that does not exist. Each is one
line on stderr and exit code 2, as `inspect`'s are."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from mapoffload.cli import main  # noqa: E402
from mapoffload.hf import convert  # noqa: E402
from conformance_zoo import build  # noqa: E402


@pytest.fixture
def no_loading(monkeypatch):
    """Any load is a failure: every refusal here comes before one."""
    from mapoffload.hf import transformers as hf_transformers

    def load(*args, **kwargs):
        raise AssertionError("loaded before refusing")

    monkeypatch.setattr(hf_transformers, "load_pretrained", load)


def _refused(capsys, *argv) -> str:
    capsys.readouterr()  # what building the folder printed
    assert main(["convert", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err  # one line
    assert captured.err.startswith("mapoffload convert: error: ")
    return captured.err


@pytest.mark.parametrize("typo", ["models/lama", "./models/lama", "/nonexistent-mapoffload/x", "../lama"])
def test_a_missing_local_path_is_named_missing(tmp_path, monkeypatch, capsys, no_loading, typo):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    err = _refused(capsys, typo)
    assert f"no such folder: {typo}" in err and "hub id" not in err


def test_a_hub_id_is_named_as_one(tmp_path, monkeypatch, capsys, no_loading):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, "meta-llama/Llama-3.2-1B")
    assert "looks like a hub id" in err and "local folders only" in err and "download" in err


def test_a_file_is_not_a_model_folder(tmp_path, capsys, no_loading):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    err = _refused(capsys, str(tmp_path / "model.safetensors"))
    assert "is a file" in err and "save_pretrained" in err


def test_a_pipeline_folder_names_its_components_and_pipeline_from_pretrained(tmp_path, capsys, no_loading):
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
        "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "PNDMScheduler"]}))
    for sub in ("text_encoder", "vae"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text("{}")
    err = _refused(capsys, str(tmp_path))
    assert "diffusers pipeline" in err and "pipeline_from_pretrained" in err
    assert str(tmp_path / "text_encoder") in err and "vae" not in err.split("pipeline folder")[-1]


def test_a_diffusers_model_folder_is_named_as_one(tmp_path, capsys, no_loading):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL",
                                                      "_diffusers_version": "0.30.0"}))
    err = _refused(capsys, str(tmp_path))
    assert "diffusers model folder" in err and "pipeline_from_pretrained" in err


def test_a_folder_without_config_says_what_it_needs(tmp_path, capsys, no_loading):
    err = _refused(capsys, str(tmp_path))
    assert "no config.json" in err and "save_pretrained" in err


@pytest.mark.parametrize("dtype", ["fp16", "float", "int8", "torch.float16", ""])
def test_a_dtype_is_checked_before_anything_loads(tmp_path, capsys, no_loading, dtype):
    # --dtype fp16 failed after the whole load had started, with transformers' own message.
    build("gpt2", str(tmp_path / "m"))
    err = _refused(capsys, str(tmp_path / "m"), "--dtype", dtype)
    assert f"{dtype!r}" in err and "auto, bfloat16, float16, float32, float64" in err
    with pytest.raises(ValueError, match="auto, bfloat16"):
        convert.convert_pretrained(str(tmp_path / "m"), dtype=dtype)


def test_a_class_name_is_checked_before_anything_loads(tmp_path, capsys, no_loading):
    build("gpt2", str(tmp_path / "m"))
    for name in ("LlamaForCausalLm", "AutoTokenizer", "os"):
        err = _refused(capsys, str(tmp_path / "m"), "--class", name)
        assert f"{name!r} is not a transformers model class" in err


def test_the_library_call_refuses_alike(tmp_path, no_loading):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        convert.convert_pretrained(str(tmp_path / "absent"))
    with pytest.raises(mapoffload.CheckpointError, match="no config.json"):
        convert.convert_pretrained(str(tmp_path))


def test_an_empty_cache_dir_is_refused_before_loading(tmp_path, capsys, no_loading):
    # --cache-dir "" loaded the whole model, then failed "creating a conversion folder under : ..."
    build("gpt2", str(tmp_path / "m"))
    err = _refused(capsys, str(tmp_path / "m"), "--cache-dir", "")
    assert "cache" in err and "empty" in err


def test_a_model_type_s_base_class_is_refused_before_loading(tmp_path, capsys, no_loading):
    # --class GPT2PreTrainedModel ended in transformers' AttributeError traceback (all_tied_weights_keys)
    build("gpt2", str(tmp_path / "m"))
    err = _refused(capsys, str(tmp_path / "m"), "--class", "GPT2PreTrainedModel")
    assert "base class" in err and "GPT2ForCausalLM" in err


def test_a_load_transformers_cannot_do_is_one_line_naming_the_folder(tmp_path, capsys):
    # A config dtype torch has no name for: transformers' AttributeError came out as a traceback.
    folder = tmp_path / "m"
    build("gpt2", str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "nonsense"
    (folder / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, str(folder))
    assert f"transformers could not load {folder}: AttributeError" in err and "nonsense" in err
    with pytest.raises(AttributeError):  # -v: the traceback, for a report
        main(["convert", str(folder), "-v"])
