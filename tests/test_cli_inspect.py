"""`mapoffload inspect` on transformers folders: what it says each entry point
does must be what that entry point then does, and what lies beside the
checkpoint (a conversion folder) is part of the picture."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import mapoffload  # noqa: E402
from conformance_zoo import build  # noqa: E402
from mapoffload.cli import main  # noqa: E402


def _with_config(folder, **extra):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(extra)
    path.write_text(json.dumps(config))


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def test_inspect_says_from_pretrained_refuses_an_awq_folder_as_it_does(tmp_path, capsys):
    import transformers as tf

    build("gpt2", str(tmp_path))
    _with_config(tmp_path, quantization_config=AWQ)
    with pytest.raises(mapoffload.CheckpointError, match="quantization_config method 'awq' is not supported"):
        mapoffload.from_pretrained(tf.GPT2LMHeadModel, tmp_path, device=None)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["entry_points"]["from_pretrained"].startswith(
        "refused: quantization_config method 'awq' is not supported by mapoffload yet (supported: fp8)")
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "from_pretrained: kept on the file mapping" not in text
    assert "from_pretrained: refused: quantization_config method 'awq'" in text
    assert max(len(line) for line in text.splitlines()[1:]) <= 100


def test_inspect_names_the_conversion_folder_a_load_left(tmp_path, capsys):
    import transformers as tf

    folder = tmp_path / "gpt2"
    build("gpt2", str(folder))
    assert main(["inspect", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["conversions"] == [] and ".mapoffload-converted" in data["conversion_root"]
    model = mapoffload.from_pretrained(tf.GPT2LMHeadModel, folder, device=None, dtype=torch.float16)
    report = model.mapoffload_report
    assert report.converted_tensors and report.conversion_dir.startswith(str(folder / ".mapoffload-converted"))
    assert main(["inspect", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (conv,) = data["conversions"]
    assert conv["path"] == report.conversion_dir and conv["tensors"] == report.converted_tensors
    assert conv["bytes"] >= report.bytes_converted and conv["finished"] is True
    assert main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert f"conversions: 1 in {folder / '.mapoffload-converted'}" in text, text
    assert f"{report.converted_tensors} tensors" in text


def test_inspect_finds_a_conversion_made_elsewhere_and_only_this_checkpoint_s(tmp_path, capsys, monkeypatch):
    """Under ``$MAPOFFLOAD_CONVERT_DIR`` (or the user's cache: a hub snapshot's) a conversion was not
    looked for: "conversions: none yet" beside a finished one. Another checkpoint's in the same root
    is not listed."""
    import transformers as tf

    root = tmp_path / "conversions"
    monkeypatch.setenv("MAPOFFLOAD_CONVERT_DIR", str(root))
    folders = [tmp_path / "a", tmp_path / "b"]
    reports = []
    for folder in folders:
        build("gpt2", str(folder))
        model = mapoffload.from_pretrained(tf.GPT2LMHeadModel, folder, device=None, dtype=torch.float16)
        reports.append(model.mapoffload_report)
        assert reports[-1].conversion_dir.startswith(str(root))
    assert main(["inspect", str(folders[0]), "--json"]) == 0
    (conv,) = json.loads(capsys.readouterr().out)["conversions"]
    assert conv["path"] == reports[0].conversion_dir and conv["finished"] is True
    assert main(["inspect", str(folders[0])]) == 0
    assert f"conversions: 1 in {root}" in capsys.readouterr().out


def test_inspect_s_gate_counts_the_local_ranks_as_the_gate_does(tmp_path, capsys, monkeypatch):
    """With 3 ranks on the host each holds its own copy and its own reserve: the reason said "178 bytes >=
    10 GiB available - 4 GiB reserve: keep mapped" (false as written) and the copy budget left the ranks out."""
    from mapoffload.memory.budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit

    build("gpt2", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", "10")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    gate, available, total = data["gate"], data["host"]["available"], data["total_bytes"]
    assert gate["local_ranks"] == 3
    assert gate["copy_budget_bytes"] == available - 3 * HOST_COPY_RESERVE_BYTES
    assert gate["keep_mapped"] == host_copies_would_not_fit(total, available_bytes=available, local_ranks=3)
    assert gate["keep_mapped"] == (3 * total >= gate["copy_budget_bytes"])  # what the reason says
    assert gate["reason"].startswith(f"3 ranks x {total} bytes >= {available} available - 3 ranks x ")


def test_inspect_says_an_unfinished_conversion_is_one(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    build("gpt2", str(folder))
    (folder / ".mapoffload-converted" / ".0123abcd.tmp").mkdir(parents=True)  # a load that never finished
    assert main(["inspect", str(folder), "--json"]) == 0
    (conv,) = json.loads(capsys.readouterr().out)["conversions"]
    assert conv["finished"] is False and conv["tensors"] == 0
    assert main(["inspect", str(folder)]) == 0
    assert "1 unfinished (no manifest: converted again by the next load)" in capsys.readouterr().out


def test_inspect_of_a_config_nested_too_deeply_says_so(tmp_path, capsys):
    build("gpt2", str(tmp_path))
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)  # RecursionError in json, a traceback
    assert main(["inspect", str(tmp_path)]) == 0
    assert "from_pretrained: refused: config.json is not valid JSON (nested too deeply)" in capsys.readouterr().out


def test_inspect_of_a_folder_whose_config_is_not_json_says_so(tmp_path, capsys):
    build("gpt2", str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "from_pretrained: refused: config.json is not valid JSON" in text


def test_a_quantization_config_that_is_not_an_object_is_named(tmp_path, capsys):
    # "fp8" as the whole quantization_config was said as "method 'None' is not supported"
    build("gpt2", str(tmp_path))
    _with_config(tmp_path, quantization_config="fp8")
    assert main(["inspect", str(tmp_path)]) == 0
    assert "refused: quantization_config is 'fp8', not the settings of a quantization method" in capsys.readouterr().out
