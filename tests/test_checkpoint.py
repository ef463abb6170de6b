"""Loader gates and load_checkpoint: formats, the gate, tied weights, bad input."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import (
    CheckpointError,
    MappedRegions,
    checkpoint_bytes,
    cow_report,
    empty_weights,
    keep_checkpoint_mapped,
    load_checkpoint,
    match_checkpoint_dtypes,
)
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB

from models import TinyModel, saveable_state


@pytest.fixture
def reference():
    torch.manual_seed(0)
    return TinyModel()


@pytest.fixture
def single(tmp_path, reference):
    path = tmp_path / "model.safetensors"
    save_file(saveable_state(reference), path)
    return path


@pytest.fixture
def sharded(tmp_path, reference):
    state = saveable_state(reference)
    keys = sorted(state)
    half = len(keys) // 2
    folder = tmp_path / "sharded"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, folder / name)
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def same_output(a, b):
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        return torch.equal(a(ids), b(ids))


def test_mapped_load_into_empty_weights(single, reference):
    with empty_weights():
        model = TinyModel()
    assert model.blocks[0].fc1.weight.device.type == "meta"
    assert model.position_ids.device.type == "cpu"  # buffers stay real
    report = load_checkpoint(model, single, keep_mapping=True)
    assert report.bytes_copied == 0 and report.copied == {}
    assert report.bytes_mapped == os.path.getsize(single) - report_header_bytes(single)
    assert MappedRegions().classify([p for p in model.parameters()]) == [True] * len(list(model.parameters()))
    assert model.head.weight is model.embed.weight  # tie kept
    assert same_output(model, reference)
    assert cow_report(list(model.parameters())).anonymous_bytes == 0
    assert "left on the file mapping" in str(report)


def report_header_bytes(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_copying_load_and_ordinary_module(single, reference):
    model = TinyModel(layers=4)
    report = load_checkpoint(model, single, keep_mapping=False)
    assert report.bytes_mapped == 0
    assert report.copied == {"keep_mapping=False": report.bytes_copied}
    assert not any(MappedRegions().classify(list(model.parameters())))
    assert model.head.weight is model.embed.weight
    assert same_output(model, reference)


def test_report_says_who_decided(single, monkeypatch):
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1000")  # copies fit
    report = load_checkpoint(TinyModel(layers=4), single)
    assert report.decided_by == "gate" and not report.keep_mapping
    assert report.copied == {"copies fit (gate)": report.bytes_copied}
    assert "the gate found copies fit" in str(report) and "keep_mapping=False" not in str(report)
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1")  # copies would not fit
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, single)
    assert report.decided_by == "gate" and "the gate found host copies would not fit" in str(report)
    report = load_checkpoint(TinyModel(layers=4), single, keep_mapping=False)
    assert report.decided_by == "caller" and "keep_mapping=False" in str(report) and "gate" not in str(report)


def test_sharded_index_and_directory(sharded, reference):
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, sharded / "model.safetensors.index.json", keep_mapping=True)
    assert len(report.files) == 2 and report.bytes_copied == 0
    assert same_output(model, reference)
    with empty_weights():
        model2 = TinyModel()
    load_checkpoint(model2, sharded, keep_mapping=True)
    assert same_output(model2, reference)
    assert checkpoint_bytes(sharded) == sum(os.path.getsize(sharded / f) for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert checkpoint_bytes(sharded / "model.safetensors.index.json") == checkpoint_bytes(sharded)


def test_torch_zip_checkpoint(tmp_path, reference):
    path = tmp_path / "model.pt"
    torch.save(saveable_state(reference), path)
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, path, keep_mapping=True)
    assert report.bytes_copied == 0 and report.bytes_mapped > 0
    assert same_output(model, reference)


def test_dtype_mismatch_is_the_only_copy(tmp_path, reference):
    state = saveable_state(reference)
    state["blocks.0.fc1.weight"] = state["blocks.0.fc1.weight"].half()
    path = tmp_path / "mixed.safetensors"
    save_file(state, path)
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, path, keep_mapping=True)
    nbytes = model.blocks[0].fc1.weight.nbytes
    assert report.copied == {"dtype": nbytes}
    assert report.bytes_copied == nbytes
    assert model.blocks[0].fc1.weight.dtype == torch.float32


def test_match_checkpoint_dtypes_keeps_objects():
    a, b, c = torch.zeros(2), torch.zeros(2, dtype=torch.float16), torch.zeros(1)
    loaded = {"a": a, "b": b, "extra": c}
    out = match_checkpoint_dtypes(loaded, {"a": torch.zeros(2), "b": torch.zeros(2)})
    assert out["a"] is a and out["extra"] is c
    assert out["b"].dtype == torch.float32 and out["b"] is not b


def test_gate_decides_with_the_checkpoint_bytes(single, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mapoffload")
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "2")  # 2 GiB host - 4 GiB reserve: nothing fits
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, single)
    assert report.keep_mapping and report.bytes_copied == 0
    assert "keeping the checkpoint mapped" in caplog.text and "TinyModel" in caplog.text
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "64")
    model = TinyModel()
    assert not load_checkpoint(model, single).keep_mapping
    assert not keep_checkpoint_mapped(weight_bytes=0, component="x")


def test_checkpoint_bytes_of_missing_path_and_hub_id(tmp_path, single):
    assert checkpoint_bytes("org/some-model") == 0
    assert checkpoint_bytes(tmp_path / "nope") == 0
    assert checkpoint_bytes(single) == os.path.getsize(single)


def test_bad_paths(tmp_path):
    model = TinyModel()
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint(model, tmp_path / "nope.safetensors")
    for remote in ("org/some-model", "https://example.com/m.safetensors"):
        with pytest.raises(ValueError, match="local paths only"):
            load_checkpoint(model, remote)


def test_corrupt_truncated_and_foreign_files(tmp_path, single):
    model = TinyModel()
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file at all")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(single.read_bytes()[:-100])
    badjson = tmp_path / "badjson.safetensors"
    badjson.write_bytes((10).to_bytes(8, "little") + b"{not json}")
    notpt = tmp_path / "model.pt"
    notpt.write_bytes(b"PK not a zip")
    for path in (garbage, truncated, badjson, notpt):
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(model, path)
        assert str(path) in str(err.value) and isinstance(err.value, ValueError)


def test_index_naming_a_missing_shard(sharded):
    os.unlink(sharded / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(TinyModel(), sharded / "model.safetensors.index.json")


def test_shape_mismatch_names_key_and_shapes(single):
    with empty_weights():
        model = TinyModel(width=16)
    with pytest.raises(ValueError, match=r"embed.weight.*\(64, 32\).*\(64, 16\)"):
        load_checkpoint(model, single, keep_mapping=True)
    assert model.embed.weight.device.type == "meta"  # untouched


def test_missing_and_unexpected_keys(tmp_path, reference):
    state = saveable_state(reference)
    del state["blocks.1.fc2.bias"]
    state["stray.weight"] = torch.zeros(1)
    path = tmp_path / "odd.safetensors"
    save_file(state, path)
    with empty_weights():
        model = TinyModel()
    with pytest.raises(ValueError, match=r"missing keys: blocks.1.fc2.bias; unexpected keys: stray.weight"):
        load_checkpoint(model, path, keep_mapping=True)
    assert model.blocks[0].fc1.weight.device.type == "meta"  # nothing half-loaded
    # Not strict: still an error, because the parameter would stay on meta.
    with pytest.raises(ValueError, match="meta device.*blocks.1.fc2.bias"):
        load_checkpoint(model, path, keep_mapping=True, strict=False)
    # An ordinary module keeps its own value for the missing key.
    plain = TinyModel()
    report = load_checkpoint(plain, path, keep_mapping=True, strict=False)
    assert report.missing_keys == ["blocks.1.fc2.bias"] and report.unexpected_keys == ["stray.weight"]
    assert "Missing keys: blocks.1.fc2.bias" in str(report)
