"""The vLLM load format's options, version range and entry point (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from mapoffload import NotLocalError
from mapoffload.vllm import VllmLoadError, VllmVersionError
from mapoffload.vllm._options import KEYS, LoaderOptions
from mapoffload.vllm.loader import TESTED, _local_folder, _safetensors_files, check_version


def test_defaults_and_values():
    assert LoaderOptions.parse(None) == LoaderOptions.parse({}) == LoaderOptions()
    assert LoaderOptions.parse({"keep_mapping": True, "linear": "mapped", "cache_dir": "/x", "stream_layers": True}) \
        == LoaderOptions(True, "mapped", "/x", True)
    assert LoaderOptions.parse({"linear": "vnni"}).linear == "vnni" and LoaderOptions.parse({}).linear is None


def test_the_keys_are_six_and_the_test_switch_is_not_one():
    assert list(KEYS) == ["keep_mapping", "linear", "stream_layers", "cache_dir", "offload_layers", "prefetch_layers"]


@pytest.mark.parametrize("linear,keep,resolved,streams", [
    ("packed", True, "packed", False), ("packed", False, "packed", False),
    ("mapped", True, "mapped", True), ("mapped", False, "mapped", True),
    ("vnni", True, "vnni", True), ("vnni", False, "vnni", True),
    (None, True, "mapped", True), (None, False, "packed", False),  # absent: packed exactly when copied
])
def test_linear_values_decide_how_linear_layers_compute(linear, keep, resolved, streams):
    options = LoaderOptions.parse({} if linear is None else {"linear": linear})
    assert options.linear == linear
    assert options.linear_for(keep) == resolved and options.streams(resolved) is streams


@pytest.mark.parametrize("old", [{"pack": True}, {"vnni": True}, {"pack": False, "linear": "mapped"},
                                 {"cpu_twin": True}])
def test_the_old_keys_are_refused_as_unknown_listing_the_current_ones(old):
    # Never released: no old key is kept (pack, vnni and cpu_twin were read with a DeprecationWarning).
    with pytest.raises(VllmLoadError, match=r"unknown key\(s\) \['(pack|vnni|cpu_twin)'\]") as info:
        LoaderOptions.parse(old)
    assert info.value.keys == tuple(k for k in old if k != "linear")
    assert "linear: how linear layers compute: 'packed'" in str(info.value) and "'vnni'" in str(info.value)


@pytest.mark.parametrize("extra,needle", [
    ([("keep_mapping", True)], "must be a dict"),
    ({"keep_maping": True}, "unknown key(s) ['keep_maping']"),
    ({"liner": "mapped"}, "did you mean linear?"),
    ({"keep_mapping": "yes"}, "keep_mapping"),
    ({"linear": True}, "['linear'] must be one of ('packed', 'mapped', 'vnni')"),
    ({"linear": "oneDNN"}, "'oneDNN'"),
    ({"cache_dir": ""}, "cache_dir"),
    ({"stream_layers": "auto"}, "stream_layers"),
    ({"stream_layers": True, "linear": "packed"}, "stream_layers=true streams mapped weights computed unpacked: it "
                                                  "cannot go with linear='packed'"),
    ({"stream_layers": True, "keep_mapping": False}, "keep_mapping=false loads with vLLM's own loader"),
    ({"linear": "vnni", "offload_layers": 2}, "cannot go with linear='vnni'"),
])
def test_bad_options_are_named(extra, needle):
    with pytest.raises(VllmLoadError) as info:
        LoaderOptions.parse(extra)
    assert needle in str(info.value)


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(VllmLoadError, match="keep_mapping: .*linear: .*cache_dir: "):
        LoaderOptions.parse({"nope": 1})


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1rc1", "0.32.0+cpu"])
def test_tested_versions_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.4.2"])
def test_other_versions_name_both(version):
    with pytest.raises(VllmVersionError) as info:
        check_version(version)
    low, high = TESTED
    assert version in str(info.value) and f">={low[0]}.{low[1]},<{high[0]}.{high[1]}" in str(info.value)


def test_folder_and_files_are_checked(tmp_path):
    with pytest.raises(NotLocalError, match="'meta-llama/Llama-3-8B' is not a local folder and looks like a hub id: "
                                            "the mapoffload load format loads local folders only"):
        _local_folder("meta-llama/Llama-3-8B")
    with pytest.raises(VllmLoadError, match="maps a local folder"):
        _local_folder("./not/here")
    import torch

    torch.save({"w": torch.zeros(2)}, str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(VllmLoadError, match="safetensors checkpoints only"):
        _safetensors_files(str(tmp_path))


def test_entry_point_is_the_register_function():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mapoffload"]
    assert [ep.value for ep in eps] == ["mapoffload.vllm:register"]


def test_importing_mapoffload_never_imports_vllm():
    code = "import sys, mapoffload, mapoffload.vllm, mapoffload.vllm.loader; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_cache_dir_that_cannot_be_a_folder_is_refused_when_parsed(tmp_path, where):
    # It ended in a bare FileExistsError / NotADirectoryError out of vLLM's loader, after the weights were read.
    afile = tmp_path / "afile"
    afile.write_text("x")
    path = afile if where == "file" else afile / "conv"
    with pytest.raises(VllmLoadError) as info:
        LoaderOptions.parse({"cache_dir": str(path)})
    message = str(info.value)
    assert "cache_dir" in message and str(path) in message
    assert (f"{afile} is a file" in message) and ("not a folder" in message)


def test_a_cache_dir_still_to_be_made_is_accepted(tmp_path):
    assert LoaderOptions.parse({"cache_dir": str(tmp_path / "a" / "b")}).cache_dir == str(tmp_path / "a" / "b")


@pytest.mark.parametrize("extra, asked, keep, why", [
    ({}, True, True, "host copies would not fit (the gate)"),
    ({"keep_mapping": False}, False, False, "keep_mapping=false in model_loader_extra_config"),
    ({"stream_layers": True}, False, True, "stream_layers=true in model_loader_extra_config"),
])
def test_the_load_format_decides_through_the_one_gate(tmp_path, monkeypatch, extra, asked, keep, why):
    """vLLM's load format keeps the mapping or copies by the one decision every loader makes
    (``loading.decide``), the gate asked with ``checkpoint_bytes`` of the folder (issue 42: it summed
    the files itself)."""
    import torch
    from safetensors.torch import save_file

    from mapoffload import checkpoint_bytes
    from mapoffload.vllm import loader

    save_file({"a": torch.zeros(64), "b": torch.ones(3, 5)}, str(tmp_path / "model.safetensors"))
    calls = []

    def gate(*, weight_bytes, component, **_):
        calls.append((weight_bytes, component))
        return True

    monkeypatch.setattr(loader, "keep_checkpoint_mapped", gate)
    body = loader._Loader.__new__(loader._Loader)
    body.options = LoaderOptions.parse(extra)
    assert body._keep(str(tmp_path), "LlamaForCausalLM") == (keep, why)
    assert calls == ([(checkpoint_bytes(tmp_path), "vLLM LlamaForCausalLM")] if asked else [])


def test_device_path_stacks_are_named_as_a_summary_names_them():
    """The device path's managers sit in the one handle type by stack path (``model.layers``), as
    ``offload``'s do; layers not found in the model are named by their place."""
    import torch

    from mapoffload.vllm._offloader import _stack_paths

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    stranger = [torch.nn.Linear(2, 2)]
    assert _stack_paths(model, [list(model.model.layers), stranger, []]) == ["model.layers", "stack 1", "stack 2"]


def test_reload_weights_from_disk_reads_the_checkpoint_as_views_of_its_mapping(tmp_path):
    """vLLM's ``reload_weights()`` without an iterator asks the load format for the weights (vLLM said only
    "Model reloading with 'mapoffload' format"): the files vLLM's own rule reads, mapped (no copy); a
    folder of PyTorch files is refused by name. (The reload itself: test_vllm_weight_updates.py.)"""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from mapoffload.memory.regions import MappedRegions
    from mapoffload.vllm.loader import _Loader

    save_file({"a": torch.arange(6.0), "b": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    got = dict(_Loader.__new__(_Loader).get_all_weights(SimpleNamespace(model=str(tmp_path)), None))
    assert torch.equal(got["a"], torch.arange(6.0)) and torch.equal(got["b"], torch.ones(2, 2))
    assert all(MappedRegions().classify(list(got.values())))
    (tmp_path / "model.safetensors").unlink()
    torch.save({"a": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(VllmLoadError, match="maps safetensors checkpoints only"):  # at the call, before vLLM
        _Loader.__new__(_Loader).get_all_weights(SimpleNamespace(model=str(tmp_path)), None)  # moves any weight
