"""`mapoffload` command rough edges: missing paths vs hub ids, non-checkpoint
files, .bin files counted, shards in natural order, -v anywhere, --version,
every option described, the demo's mode and its own budget."""

from __future__ import annotations

import argparse
import io
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import mapoffload
from mapoffload.cli import build_parser, main
from mapoffload.cli.demo import DemoConfig, run_demo


@pytest.fixture
def llama(tmp_path, monkeypatch):
    """tmp/models/llama/model.safetensors; the working directory is tmp."""
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    save_file({"w": torch.ones(4, 4)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.chdir(tmp_path)
    return folder


@pytest.mark.parametrize("typo", ["models/lama", "./models/lama", "models/llama/model.safetensor",
                                  "/nonexistent-mapoffload/x", "~/nonexistent-mapoffload-dir/x", "../lama"])
def test_a_mistyped_local_path_is_missing_not_a_hub_id(llama, capsys, typo):
    assert main(["inspect", typo]) == 2
    err = capsys.readouterr().err
    assert f"no such file or folder: {os.path.expanduser(typo)}" in err and "hub id" not in err  # ~ expanded


def test_a_hub_id_is_named_as_one(llama, capsys):
    assert main(["inspect", "meta-llama/Llama-3.2-1B"]) == 2
    err = capsys.readouterr().err
    assert "looks like a hub id" in err and "local paths only" in err


def test_a_non_checkpoint_file_is_refused(llama, capsys):
    assert main(["inspect", "models/llama/config.json"]) == 2
    err = capsys.readouterr().err
    assert "config.json: is not a checkpoint file" in err
    with pytest.raises(mapoffload.CheckpointError, match="not a checkpoint file"):
        mapoffload.checkpoint_files(llama / "config.json")
    assert main(["inspect", "models/llama"]) == 0  # the folder is fine
    capsys.readouterr()


def test_bin_files_are_counted(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    torch.save({"a": torch.zeros(8, 8), "b": torch.zeros(3, dtype=torch.float16), "c": torch.zeros(2, 2)},
               folder / "pytorch_model.bin")
    assert main(["inspect", str(folder), "--json"]) == 0
    comp = json.loads(capsys.readouterr().out)["components"][0]
    assert comp["tensors"] == 3 and comp["files"][0]["tensors"] == 3
    assert comp["files"][0]["dtypes"] == {"F32": 2, "F16": 1}
    assert comp["bytes"] == (folder / "pytorch_model.bin").stat().st_size
    assert main(["inspect", str(folder)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if "pytorch_model.bin" in line)
    assert row.split()[3] == "3" and "F16x1, F32x2" in row and "?" not in row


def test_shards_in_natural_order(tmp_path, capsys):
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    # weight_map keys sort so that shard 3 is named first
    weight_map = {"a.w": names[2], "b.w": names[0], "c.w": names[1]}
    for key, name in weight_map.items():
        save_file({key: torch.zeros(2)}, folder / name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    files = mapoffload.checkpoint_files(folder)
    assert [f.rsplit("/", 1)[1] for f in files] == names
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert [out.index(n) for n in names] == sorted(out.index(n) for n in names)
    loose = tmp_path / "loose"
    loose.mkdir()
    for i in (10, 2, 1):
        save_file({f"w{i}": torch.zeros(1)}, loose / f"part-{i}.safetensors")
    assert [f.rsplit("/", 1)[1] for f in mapoffload.checkpoint_files(loose)] == [
        "part-1.safetensors", "part-2.safetensors", "part-10.safetensors"]


@pytest.mark.parametrize("argv, verbose", [
    (["-v", "inspect", "x"], True),
    (["inspect", "x", "-v"], True),
    (["inspect", "--verbose", "x"], True),
    (["inspect", "x"], False),
    (["demo", "-v", "--layers", "2"], True),
    (["--verbose", "demo"], True),
])
def test_verbose_anywhere(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"mapoffload {mapoffload.__version__}"


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_of_every_subcommand_is_described():
    parser = build_parser()
    subs = dict(_subparsers(parser))
    assert set(subs) == {"inspect", "demo", "convert"}
    for name, sub in [("mapoffload", parser), *subs.items()]:
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings or action.dest)


def test_demo_options_are_checked(capsys):
    for argv in (["demo", "--layers", "0"], ["demo", "--width", "wide"], ["demo", "--host-gib", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "must be 1 or more" in capsys.readouterr().err


def test_demo_in_place_says_so_and_copies_nothing():
    out = io.StringIO()
    rc = run_demo(DemoConfig(layers=3, width=512, tokens=8, steps=1, device="cpu"), out)
    text = out.getvalue()
    assert rc == 0, text
    assert text.startswith("mode: in place on the CPU") and "copied to" not in text
    assert "computed from there" in text and "none: nothing is copied in place" in text
    assert text.rstrip().endswith("OK")


def test_demo_fails_when_its_own_budget_is_exceeded(monkeypatch):
    # A gate made to copy: the copies (the whole 24 MiB checkpoint) are host memory,
    # twice the budget, on top of the twin's buffers and the staging ring.
    import mapoffload.loading.checkpoint as checkpoint

    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", "0.25")  # a 1 MiB ring: the size is one the demo can judge
    real = checkpoint.load_checkpoint
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda module, path, **kw: real(module, path, keep_mapping=False))
    out = io.StringIO()
    rc = run_demo(DemoConfig(layers=8, width=256, tokens=8, steps=1, device="cpu", cpu_twin=True), out)
    text = out.getvalue()
    assert rc == 1, text
    assert text.startswith("mode: CPU twin of the device pipeline") and "copied to its CPU buffer" in text
    assert re.search(r"FAILED: anonymous memory grew by [0-9.]+ MiB, over the 12\.0\d MiB host budget", text), text
    assert re.search(r"the gate's copies 24\.0\d MiB", text) and "staging ring 1.00 MiB" in text
    assert not text.rstrip().endswith("OK")


def test_demo_counts_the_twins_buffers_when_the_allocator_reuses_freed_memory(monkeypatch):
    # CI saw the RSS delta at 20 KiB: the buffers came from memory freed before the
    # baseline. The demo must still see the twin's buffers as host memory.
    import mapoffload.cli.demo as demo

    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", "0.25")
    monkeypatch.setattr(demo, "rss_anon_bytes", lambda: 1 << 30)
    out = io.StringIO()
    rc = run_demo(DemoConfig(layers=8, width=256, tokens=8, steps=1, device="cpu", cpu_twin=True), out)
    text = out.getvalue()
    assert rc == 0, text
    grew = re.search(r"host anonymous growth +([0-9.]+) MiB", text)
    assert grew and float(grew.group(1)) >= 3.0, text  # at least one 3 MiB layer buffer


def test_inspect_fits_100_columns(tmp_path, capsys):
    folder = tmp_path / ("a-rather-long-component-folder-name-" * 3)
    folder.mkdir()
    name = "diffusion_pytorch_model-with-a-very-long-name-00001-of-00001.safetensors"
    save_file({f"w{i}": torch.zeros(2, dtype=d) for i, d in enumerate((torch.float32, torch.bfloat16))},
              folder / name)
    assert main(["inspect", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in lines[1:]), lines  # the first line names the path as given
    assert any(line.strip().startswith("…") and line.split()[0].endswith("00001.safetensors") for line in lines)


def test_inspect_says_what_each_entry_point_does(tmp_path, capsys, monkeypatch):
    """One rule: from_pretrained keeps what transformers maps; load_checkpoint asks the gate."""
    import json as _json

    pytest.importorskip("transformers")
    from conformance_zoo import build
    from mapoffload.cli import main

    build("gpt2", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1000")  # copies fit: the gate would copy
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    data = _json.loads(capsys.readouterr().out)
    assert data["entry_points"]["from_pretrained"].startswith("kept on the file mapping")
    assert data["entry_points"]["load_checkpoint"].startswith("copied into host memory")
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "from_pretrained: kept on the file mapping" in text
    assert "gate: copy into host memory (load_checkpoint" in text
    assert max(len(line) for line in text.splitlines()) <= 100


@pytest.mark.parametrize("host_gib", ["1", "1000"])  # below the 4 GiB reserve (the gate keeps) / copies fit
def test_inspect_matches_what_each_entry_point_then_does(tmp_path, monkeypatch, host_gib):
    pytest.importorskip("transformers")
    import transformers as tf

    from conformance_zoo import build
    from mapoffload.cli.inspect import inspect_checkpoint

    build("gpt2", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", host_gib)
    data = inspect_checkpoint(str(tmp_path))
    gate_keeps = data["gate"]["keep_mapped"]
    assert gate_keeps == (host_gib == "1")
    with mapoffload.empty_weights():
        model = tf.GPT2LMHeadModel(tf.GPT2Config.from_pretrained(str(tmp_path)))
    report = mapoffload.load_checkpoint(model, str(tmp_path), strict=False)
    assert report.keep_mapping == gate_keeps and report.decided_by == "gate"
    assert data["entry_points"]["load_checkpoint"].startswith("kept" if gate_keeps else "copied")
    hf = mapoffload.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path), device=None).mapoffload_report
    assert data["entry_points"]["from_pretrained"].startswith("kept on the file mapping")
    assert hf.keep_mapping and hf.bytes_copied == 0 and hf.decided_by == "caller"  # keep_mapping=True, the default
    # keep_mapping=None means what it means for load_checkpoint: the gate decides, with the bytes the model maps.
    gated = mapoffload.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path), device=None, keep_mapping=None)
    report = gated.mapoffload_report
    assert report.decided_by == "gate" and report.keep_mapping == gate_keeps
    assert (report.copied.get("copies fit (gate)", 0) > 0) == (not gate_keeps), report.copied
    assert ("the gate found" in str(report)), str(report)
    held = mapoffload.MappedRegions().classify([p for p in gated.parameters()])
    assert all(held) if gate_keeps else not any(held)


def test_inspect_into_a_closed_pipe_exits_quietly(llama):
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # `mapoffload inspect ... | head -0`: the reader is gone before the first write
    try:
        r = subprocess.run([sys.executable, "-m", "mapoffload", "inspect", str(llama)], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr  # as a shell reports SIGPIPE, and no error line


def test_inspect_of_unreadable_files_and_folders_is_one_line(llama, capsys, monkeypatch):
    # chmod 000 does not stop root: the refusals the kernel would make are made here.
    import errno
    import os

    import mapoffload.loading.files as files

    real_open, real_listdir = os.open, os.listdir

    def no_read(path, *args, **kwargs):
        if str(path).endswith("model.safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", no_read)
    assert main(["inspect", "models/llama/model.safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mapoffload inspect: error: models/llama/model.safetensors: cannot be read") and \
        "Permission denied" in err and err.count("\n") == 1, err
    monkeypatch.setattr(files.os, "open", real_open)

    def no_list(path="."):
        if str(path).rstrip("/").endswith("llama"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(files.os, "listdir", no_list)
    assert main(["inspect", "models/llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mapoffload inspect: error: ") and "Permission denied" in err and err.count("\n") == 1, err
