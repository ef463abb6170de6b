"""A checkpoint's file set: one definition (``checkpoint_files``) that the
byte count, the loader and inspect all use; duplicate keys, index paths
outside the folder, malformed indexes and non-regular files are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import mapoffload.loading.checkpoint as checkpoint_module
from mapoffload import CheckpointError, checkpoint_bytes, checkpoint_files, empty_weights, load_checkpoint
from mapoffload.cli.inspect import inspect_checkpoint

from models import TinyModel, saveable_state

INDEX = "model.safetensors.index.json"


def sizes(files):
    return sum(os.path.getsize(f) for f in files)


def write_sharded(folder, state, parts=2, index=INDEX):
    """Shards of ``state`` and an index naming them; returns the shard paths."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    weight_map, shards = {}, []
    for i in range(parts):
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        part = keys[i::parts]
        save_file({k: state[k] for k in part}, folder / name)
        weight_map.update({k: name for k in part})
        shards.append(str(folder / name))
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


@pytest.fixture
def state():
    torch.manual_seed(0)
    return saveable_state(TinyModel())


# --- 1. one definition of the file set; checkpoint_bytes counts exactly it ------------


def test_index_wins_over_a_consolidated_file_beside_the_shards(tmp_path, state):
    folder = tmp_path / "hf"
    shards = write_sharded(folder, state)
    save_file(state, folder / "consolidated.safetensors")  # what HF folders often ship too
    (folder / "original").mkdir()
    save_file(state, folder / "original" / "consolidated.safetensors")
    assert checkpoint_files(folder) == shards
    assert checkpoint_bytes(folder) == sizes(shards)
    assert checkpoint_bytes(folder / INDEX) == sizes(shards)


def test_top_level_files_only_not_sub_folders(tmp_path, state):
    folder = tmp_path / "plain"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    (folder / "original").mkdir()
    save_file(state, folder / "original" / "consolidated.safetensors")
    assert checkpoint_files(folder) == [str(folder / "model.safetensors")]
    assert checkpoint_bytes(folder) == os.path.getsize(folder / "model.safetensors")


def test_pipeline_root_applies_the_rule_to_each_component(tmp_path, state):
    root = tmp_path / "pipeline"
    vae = root / "vae"
    vae.mkdir(parents=True)
    save_file({"w": torch.zeros(8)}, vae / "diffusion_pytorch_model.safetensors")
    shards = write_sharded(root / "transformer", state, index="diffusion_pytorch_model.safetensors.index.json")
    save_file(state, root / "transformer" / "consolidated.safetensors")  # not read: the index decides
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab.json").write_text("{}")
    (root / "model_index.json").write_text("{}")
    expected = shards + [str(vae / "diffusion_pytorch_model.safetensors")]
    assert checkpoint_files(root) == expected
    assert checkpoint_bytes(root) == sizes(expected)


def test_checkpoint_bytes_is_the_size_of_checkpoint_files(tmp_path, state):
    single = tmp_path / "one.safetensors"
    save_file(state, single)
    folder = tmp_path / "sharded"
    write_sharded(folder, state, parts=3)
    for path in (single, folder, folder / INDEX):
        assert checkpoint_bytes(path) == sizes(checkpoint_files(path))
    assert checkpoint_bytes("org/some-model") == 0
    assert checkpoint_bytes(tmp_path / "missing") == 0


def test_inspect_reports_the_same_file_set(tmp_path, state):
    folder = tmp_path / "hf"
    shards = write_sharded(folder, state)
    save_file(state, folder / "consolidated.safetensors")
    (folder / "original").mkdir()
    save_file(state, folder / "original" / "consolidated.safetensors")
    data = inspect_checkpoint(folder)
    assert [f["path"] for c in data["components"] for f in c["files"]] == shards
    assert data["total_bytes"] == checkpoint_bytes(folder)


def test_two_indexes_in_one_folder_are_ambiguous(tmp_path, state):
    folder = tmp_path / "variants"
    write_sharded(folder, state)
    write_sharded(folder, state, index="model.fp16.safetensors.index.json")
    with pytest.raises(CheckpointError, match="model.fp16.safetensors.index.json"):
        checkpoint_files(folder)
    assert len(checkpoint_files(folder / INDEX)) == 2  # naming one is fine


def test_the_gate_is_asked_with_the_bytes_the_load_reads(tmp_path, state, monkeypatch):
    folder = tmp_path / "hf"
    write_sharded(folder, state)
    save_file(state, folder / "consolidated.safetensors")
    asked = []

    def gate(*, weight_bytes, component, **_):
        asked.append(weight_bytes)
        return True

    monkeypatch.setattr(checkpoint_module, "keep_checkpoint_mapped", gate)
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, folder)
    assert asked == [sizes(report.files)]


# --- 2. a key in two files -----------------------------------------------------------


def test_key_in_two_files_is_an_error_naming_both(tmp_path, state):
    folder = tmp_path / "dup"
    folder.mkdir()
    save_file(state, folder / "a.safetensors")
    save_file({"embed.weight": torch.zeros_like(state["embed.weight"])}, folder / "b.safetensors")
    with empty_weights():
        model = TinyModel()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, folder, keep_mapping=True)
    msg = str(err.value)
    assert "embed.weight" in msg and "a.safetensors" in msg and "b.safetensors" in msg
    assert model.embed.weight.device.type == "meta"  # nothing assigned


def test_shard_holding_a_key_of_another_shard_is_an_error(tmp_path, state):
    folder = tmp_path / "hf"
    shards = write_sharded(folder, state)
    extra = dict(state)  # the second shard now also holds every key of the first
    save_file(extra, shards[1])
    with pytest.raises(CheckpointError, match="in both"):
        load_checkpoint(TinyModel(), folder, keep_mapping=True)


# --- 3. index paths outside the folder, malformed indexes --------------------------------


def write_index(folder, weight_map_or_doc):
    folder.mkdir(parents=True, exist_ok=True)
    doc = weight_map_or_doc
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (folder / INDEX).write_text(text)
    return folder / INDEX


@pytest.mark.parametrize("where", ["dotdot", "absolute"])
def test_index_naming_a_file_outside_the_folder(tmp_path, state, where):
    outside = tmp_path / "outside.safetensors"
    save_file(state, outside)
    name = "../outside.safetensors" if where == "dotdot" else str(outside)
    index = write_index(tmp_path / "ckpt", {"weight_map": {k: name for k in state}})
    for call in (checkpoint_files, checkpoint_bytes, lambda p: load_checkpoint(TinyModel(), p)):
        with pytest.raises(CheckpointError, match="outside"):
            call(index)


def test_index_naming_symlinks_elsewhere_loads_their_targets(tmp_path, state):
    """Shards that are links out of the folder (older hub ``local_dir`` downloads) load, as
    transformers loads them (issue 41; they were refused): the link's target is mapped."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_file(state, elsewhere / "x.safetensors")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(elsewhere, folder / "sub")  # a directory link
    os.symlink(elsewhere / "x.safetensors", folder / "link.safetensors")  # a file link
    for name in ("sub/x.safetensors", "link.safetensors"):
        index = write_index(folder, {"weight_map": {k: name for k in state}})
        assert checkpoint_files(index) == [str(folder / name)]
        with empty_weights():
            model = TinyModel()
        report = load_checkpoint(model, folder, keep_mapping=True)
        assert report.files == [str(folder / name)] and report.bytes_copied == 0
        loaded = model.state_dict()
        for k, v in state.items():
            assert torch.equal(loaded[k], v)


def test_relative_paths_stay_relative(tmp_path, state, monkeypatch):
    write_sharded(tmp_path / "hf", state)
    monkeypatch.chdir(tmp_path / "hf")
    expected = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert checkpoint_files(INDEX) == expected
    assert checkpoint_files(".") == expected  # normalised: no "./"
    assert checkpoint_files(f"../hf/{INDEX}") == [f"../hf/{e}" for e in expected]
    assert checkpoint_bytes(INDEX) == sizes(expected)


def test_hub_cache_layout_with_blob_links_loads(tmp_path, state):
    """The Hugging Face cache stores every file as a link into ``blobs/``."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs = repo / "blobs"
    snap = repo / "snapshots" / "0123abcd"
    shards = write_sharded(tmp_path / "staging", state)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, shard in enumerate(shards):
        os.replace(shard, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / os.path.basename(shard))
    os.replace(tmp_path / "staging" / INDEX, blobs / "index")
    os.symlink("../../blobs/index", snap / INDEX)
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, snap, keep_mapping=True)
    assert report.files == [str(snap / os.path.basename(s)) for s in shards]
    assert checkpoint_bytes(snap) == sizes(report.files)


@pytest.mark.parametrize(
    "doc",
    [
        "[1, 2]",
        "42",
        "not json",
        {"metadata": {}},
        {"weight_map": ["a.safetensors"]},
        {"weight_map": {"w": 3}},
        {"weight_map": {"w": None}},
        {"weight_map": {"w": ""}},
        {"weight_map": {}},
        "[" * 100000 + "]" * 100000,
    ],
    ids=["list", "number", "not-json", "no-weight-map", "map-list", "value-int", "value-null", "value-empty",
         "empty", "deep"],
)
def test_malformed_index_is_a_checkpoint_error(tmp_path, doc):
    index = write_index(tmp_path / "ckpt", doc)
    for call in (checkpoint_files, checkpoint_bytes, lambda p: load_checkpoint(TinyModel(), p)):
        with pytest.raises(CheckpointError) as err:
            call(index)
        assert str(index) in str(err.value)


# --- 4. non-regular files -------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    from mapoffload import CheckpointError, load_checkpoint
    from torch import nn
    try:
        load_checkpoint(nn.Linear(2, 2), sys.argv[1], keep_mapping=True)
    except CheckpointError as exc:
        print("CheckpointError", exc)
    """
)


def load_in_child(path, cwd):
    """The load in a child with a timeout, so a hang fails instead of blocking the suite."""
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=30,
                           cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"load_checkpoint({path}) blocked")
    return r


@pytest.mark.parametrize("layout", ["file", "in-folder", "shard", "index"])
def test_fifo_is_refused_not_waited_on(tmp_path, layout):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if layout == "file":
        target = fifo = folder / "model.safetensors"
    elif layout == "in-folder":
        fifo, target = folder / "model.safetensors", folder
    elif layout == "shard":
        fifo, target = folder / "model-00001-of-00001.safetensors", folder
        write_index(folder, {"weight_map": {"weight": fifo.name}})
    else:
        fifo = target = folder / INDEX
    os.mkfifo(fifo)
    r = load_in_child(target, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("CheckpointError") and str(fifo) in r.stdout and "regular" in r.stdout
    with pytest.raises(CheckpointError, match="regular"):
        checkpoint_files(target)


def test_fifo_in_inspect_is_a_one_line_error(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    try:
        r = subprocess.run([sys.executable, "-m", "mapoffload", "inspect", str(fifo)], capture_output=True,
                           text=True, timeout=30, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("mapoffload inspect blocked on a FIFO")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert str(fifo) in r.stderr


def test_directory_named_like_a_weight_file(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="regular") as err:
        checkpoint_files(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(err.value)


def test_a_link_loop_or_a_name_too_long_is_said_as_it_is(tmp_path):
    """Both were "no such file or folder": a loop of links, a name longer than the file system takes."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(CheckpointError, match="Too many levels of symbolic links"):
        checkpoint_files(tmp_path / "a")
    with pytest.raises(CheckpointError, match="File name too long"):
        checkpoint_files(tmp_path / ("x" * 300))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        checkpoint_files(tmp_path / "absent")


def test_vllm_reads_the_hf_index_beside_a_consolidated_one(tmp_path):
    """Mistral's repos: ``model.safetensors.index.json`` and its shards beside ``consolidated.safetensors``
    and its own index. vLLM serves the folder from the first; the ``mapoffload`` load format refused it
    ("2 safetensors indexes: name the one to load"), which a vLLM user cannot do."""
    from mapoffload.loading.files import vllm_files
    from mapoffload.vllm.loader import _safetensors_files

    t = {"a": torch.ones(2)}
    save_file(t, str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file(t, str(tmp_path / "consolidated.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    (tmp_path / "consolidated.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "consolidated.safetensors"}}))
    with pytest.raises(CheckpointError, match="2 safetensors indexes"):
        checkpoint_files(tmp_path)  # the general rule asks
    shards = [str(tmp_path / "model-00001-of-00001.safetensors")]
    assert vllm_files(tmp_path) == _safetensors_files(str(tmp_path)) == shards
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "consolidated.safetensors.index.json").unlink()
    assert vllm_files(tmp_path) == [str(tmp_path / "consolidated.safetensors")] + shards  # vLLM's glob


def test_vllm_s_rule_refuses_pytorch_files_by_name(tmp_path):
    from mapoffload.vllm import VllmLoadError
    from mapoffload.vllm.loader import _safetensors_files

    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(VllmLoadError, match="pytorch_model.bin: the mapoffload load format maps safetensors"):
        _safetensors_files(str(tmp_path))
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        _safetensors_files(str(tmp_path))


def test_vllm_s_rule_skips_hidden_files_and_names_a_missing_shard(tmp_path):
    """vLLM globs ``*.safetensors``, which matches no hidden file (a hidden copy made mapoffload refuse a
    key "in both"); an index naming a missing shard, beside a ``.bin``, was "safetensors only"."""
    from mapoffload.loading.files import vllm_files
    from mapoffload.vllm.loader import _safetensors_files

    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / ".model.safetensors"))
    assert vllm_files(tmp_path) == [str(tmp_path / "model.safetensors")]
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is missing"):
        _safetensors_files(str(tmp_path))
