"""`mapoffload inspect` and `mapoffload demo`, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from mapoffload.cli import main
from mapoffload.cli.inspect import read_safetensors_header

from conftest import drop_page_cache


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mapoffload", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.fixture
def model_dir(tmp_path):
    root = tmp_path / "pipeline"
    (root / "vae").mkdir(parents=True)
    (root / "transformer").mkdir()
    (root / "tokenizer").mkdir()
    save_file({"enc.weight": torch.zeros(64, 64), "dec.weight": torch.zeros(64, 64, dtype=torch.float16)},
              root / "vae" / "diffusion_pytorch_model.safetensors")
    shard_map = {}
    for i in range(2):
        name = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
        save_file({f"blocks.{i}.weight": torch.ones(256, 256)}, root / "transformer" / name)
        shard_map[f"blocks.{i}.weight"] = name
    (root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": shard_map}))
    (root / "tokenizer" / "vocab.json").write_text("{}")
    return root


def test_inspect_json_of_a_diffusers_style_folder(model_dir, capsys):
    assert main(["inspect", str(model_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    comps = {c["component"]: c for c in data["components"]}
    assert set(comps) == {"vae", "transformer"}
    assert comps["vae"]["tensors"] == 2
    assert comps["vae"]["files"][0]["dtypes"] == {"F32": 1, "F16": 1}
    assert comps["transformer"]["tensors"] == 2 and len(comps["transformer"]["files"]) == 2
    assert data["total_bytes"] == comps["vae"]["bytes"] + comps["transformer"]["bytes"]
    assert data["gate"]["keep_mapped"] is False and data["gate"]["reserve_bytes"] == 4 << 30
    assert "available" in data["host"]["summary"]


def test_inspect_table_and_residency(tmp_path, capsys, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(4 << 20)}, path)
    drop_page_cache(path)
    assert main(["inspect", str(path), "--json"]) == 0
    cold = json.loads(capsys.readouterr().out)["components"][0]["resident_bytes"]
    path.read_bytes()
    assert main(["inspect", str(path), "--json"]) == 0
    hot = json.loads(capsys.readouterr().out)["components"][0]["resident_bytes"]
    assert cold < os.path.getsize(path) // 2 and hot == os.path.getsize(path)
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "1")
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "gate: keep the checkpoint mapped (load_checkpoint" in text and "F32x1" in text and "in page cache" in text


def test_inspect_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    for target in (tmp_path / "missing", bad, tmp_path):
        r = run_cli("inspect", str(target), cwd=tmp_path)
        assert r.returncode == 2, r
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert str(target) in r.stderr


def test_header_reader_rejects_garbage(tmp_path):
    short = tmp_path / "s.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        read_safetensors_header(str(short))


def test_demo_runs_end_to_end(tmp_path):
    # Width 512: a 9 MiB checkpoint, so its half (the budget) is well above the activations.
    r = run_cli("demo", "--layers", "3", "--width", "512", "--tokens", "16", "--steps", "1", "--device", "cpu",
                cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("mode: in place on the CPU")
    assert "mapping turned anonymous  0 bytes" in r.stdout
    assert "identical to the reference" in r.stdout and r.stdout.rstrip().endswith("OK")
    assert "layer 3/3" in r.stdout
