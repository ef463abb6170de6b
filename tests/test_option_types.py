"""Options are checked for their type where they are read, and paths a user types are expanded.

Issue 36: ``keep_mapping="false"`` kept the mapping (a non-empty string is truthy) and the report
said True; ``prefetch_layers=1.5`` was accepted and the first forward died with a bare TypeError;
``cache_dir="~/conv"`` (and ``--cache-dir=~/conv``, where the shell leaves ``~`` alone) made a
folder named ``~`` in the current directory.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import mapoffload
from mapoffload import LayerwiseOffloadManager, checkpoint_bytes, checkpoint_files, empty_weights, load_checkpoint
from mapoffload.loading.checkpoint import keep_checkpoint_mapped

from models import TinyModel, saveable_state

GIB = 1 << 30


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file(saveable_state(TinyModel(width=16, layers=3)), path)
    return path


def _meta_model():
    with empty_weights():
        return TinyModel(width=16, layers=3)


def _mapped_model(ckpt):
    model = _meta_model()
    load_checkpoint(model, ckpt, keep_mapping=True)
    return model


# --- load_checkpoint and the gate ---------------------------------------------------------------


@pytest.mark.parametrize("option,value,error", [
    ("keep_mapping", "false", TypeError),
    ("keep_mapping", 0, TypeError),
    ("keep_mapping", "true", TypeError),
    ("strict", "no", TypeError),
    ("strict", None, TypeError),
    ("progress", "yes", TypeError),
    ("local_ranks", 1.5, TypeError),
    ("local_ranks", True, TypeError),
    ("local_ranks", "2", TypeError),
    ("local_ranks", 0, ValueError),
])
def test_load_checkpoint_refuses_a_wrong_type_naming_the_option(ckpt, option, value, error):
    model = _meta_model()
    with pytest.raises(error) as info:
        load_checkpoint(model, ckpt, **{option: value})
    assert option in str(info.value) and repr(value) in str(info.value)
    assert all(p.device.type == "meta" for p in model.parameters())  # refused before anything was assigned


def test_keep_mapping_false_as_a_bool_copies_and_says_so(ckpt):
    model = _meta_model()
    report = load_checkpoint(model, ckpt, keep_mapping=False)
    assert report.keep_mapping is False and report.bytes_mapped == 0


@pytest.mark.parametrize("kwargs,error", [
    ({"weight_bytes": 1.5}, TypeError),
    ({"weight_bytes": True}, TypeError),
    ({"weight_bytes": -1}, ValueError),
    ({"weight_bytes": 10, "local_ranks": 2.0}, TypeError),
])
def test_the_gate_refuses_a_wrong_count(kwargs, error):
    with pytest.raises(error) as info:
        keep_checkpoint_mapped(component="x", **kwargs)
    name = "local_ranks" if "local_ranks" in kwargs else "weight_bytes"
    assert name in str(info.value) and repr(kwargs[name]) in str(info.value)


# --- the manager's options (resolved once, in offload/manager.py) ---------------------------------


@pytest.mark.parametrize("option,value,error", [
    ("prefetch_layers", 1.5, TypeError),
    ("prefetch_layers", True, TypeError),
    ("prefetch_layers", "1", TypeError),
    ("prefetch_layers", -1, ValueError),
    ("resident_layers", 2.0, TypeError),
    ("resident_layers", -2, ValueError),
    ("cpu_twin", "false", TypeError),
    ("cpu_twin", 1, TypeError),
    ("local_ranks", 2.0, TypeError),
    ("local_ranks", False, TypeError),
    ("page_cache_bytes", 1.5, TypeError),
    ("page_cache_bytes", -1, ValueError),
    ("available_bytes", True, TypeError),
    ("available_bytes", 4.0 * GIB, TypeError),
    ("available_bytes", -1, ValueError),
    ("device", 1.5, TypeError),
    ("device", "gpu", ValueError),
])
def test_the_manager_refuses_a_wrong_type_naming_the_option(ckpt, option, value, error):
    model = _mapped_model(ckpt)
    kwargs = {"device": "cpu", option: value}
    with pytest.raises(error) as info:
        LayerwiseOffloadManager(model, "blocks", **kwargs)
    assert option in str(info.value) and repr(value) in str(info.value)


def test_a_whole_prefetch_count_still_computes(ckpt):
    model = _mapped_model(ckpt)
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        expected = model(ids)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=2, cpu_twin=True) as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(ids), expected)


def test_replan_refuses_a_wrong_page_cache_bytes(ckpt):
    model = _mapped_model(ckpt)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        with pytest.raises(TypeError, match=r"page_cache_bytes.*1\.5"):
            mgr.parts.replan(1.5)


# --- paths a user types: ~ is the home folder ---------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME in one tmp folder, the current directory in another: a folder named ``~`` would land in the latter."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MAPOFFLOAD_CONVERT_DIR", raising=False)
    yield home
    assert not os.path.lexists(cwd / "~"), "a folder named '~' was made in the current directory"


def test_checkpoint_paths_expand_the_home_folder(ckpt, home):
    (home / "w.safetensors").write_bytes(ckpt.read_bytes())
    assert checkpoint_files("~/w.safetensors") == [str(home / "w.safetensors")]
    assert checkpoint_bytes("~/w.safetensors") == ckpt.stat().st_size
    model = _meta_model()
    report = load_checkpoint(model, "~/w.safetensors", keep_mapping=True)
    assert report.files == [str(home / "w.safetensors")] and report.bytes_mapped > 0


def test_the_inspect_command_expands_the_home_folder(ckpt, home, capsys):
    from mapoffload.cli import main

    (home / "w.safetensors").write_bytes(ckpt.read_bytes())
    assert main(["inspect", "~/w.safetensors"]) == 0
    assert str(home / "w.safetensors") in capsys.readouterr().out


def test_the_conversion_root_expands_the_home_folder(home, monkeypatch):
    from mapoffload.conversion import cache as _converted, naming as _fingerprint

    assert _converted.ConversionCache("~/conv", "k").path == str(home / "conv" / "k")
    monkeypatch.setenv("MAPOFFLOAD_CONVERT_DIR", "~/env")
    assert _fingerprint.default_root(str(home)) == str(home / "env")


def test_from_pretrained_cache_dir_expands_the_home_folder(tmp_path, home):
    pytest.importorskip("transformers")
    import mapoffload
    from conformance_zoo import build

    cls, _ = build("mixtral", str(tmp_path / "m"))
    model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None, cache_dir="~/models/conv")
    report = model.mapoffload_report
    assert report.converted_tensors and report.conversion_dir.startswith(str(home / "models" / "conv") + os.sep)


def test_the_convert_command_expands_the_home_folder(tmp_path, home, capsys):
    pytest.importorskip("transformers")
    from conformance_zoo import build
    from mapoffload.cli import main

    build("mixtral", str(tmp_path / "m"))
    assert main(["convert", str(tmp_path / "m"), "--cache-dir=~/conv"]) == 0
    assert os.path.isdir(home / "conv") and os.listdir(home / "conv")


def test_the_vllm_cache_dir_expands_the_home_folder(home):
    from mapoffload.vllm._options import LoaderOptions

    assert LoaderOptions.parse({"cache_dir": "~/conv"}).cache_dir == str(home / "conv")


def test_from_pretrained_takes_a_folder_under_home_as_typed(home):
    """``from_pretrained(cls, "~/models/x")``: the folder a user types, ``~`` expanded."""
    pytest.importorskip("transformers")
    from hf_models import save

    cls = save("llama", torch.float32, home / "models" / "tiny")
    model = mapoffload.from_pretrained(cls, "~/models/tiny", device="cpu")
    model.mapoffload_handle.close()


@pytest.mark.parametrize("bad", [1.5, "2", True])
def test_local_world_takes_whole_numbers_only(bad):
    from mapoffload import local_world

    with pytest.raises(TypeError, match=rf"local_ranks must be a whole number >= 1, not {bad!r}"):
        local_world(bad)
