"""load_checkpoint shows a tqdm bar over the files of a sharded checkpoint
(when tqdm is installed), and none with progress=False."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from safetensors.torch import save_file  # noqa: E402

from mapoffload import load_checkpoint  # noqa: E402


def _shards(folder, n):
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(n)))
    for i in range(n):
        save_file({f"{i}.weight": model[i].weight.detach().clone(), f"{i}.bias": model[i].bias.detach().clone()},
                  str(folder / f"part-{i}.safetensors"))
    return model


def test_bar_over_shards_and_off_switch(tmp_path, capsys):
    model = _shards(tmp_path, 8)
    load_checkpoint(model, tmp_path, keep_mapping=True)
    err = capsys.readouterr().err
    assert "Loading checkpoint" in err and "/8 " in err  # many shards: a bar at once
    load_checkpoint(model, tmp_path, keep_mapping=True, progress=False)
    assert "Loading checkpoint" not in capsys.readouterr().err


def test_a_quick_load_of_few_shards_stays_quiet(tmp_path, capsys):
    model = _shards(tmp_path, 3)
    load_checkpoint(model, tmp_path, keep_mapping=True)
    assert "Loading checkpoint" not in capsys.readouterr().err
    load_checkpoint(model, tmp_path, keep_mapping=True, progress=True)
    assert "/3 " in capsys.readouterr().err


def test_a_host_copy_longer_than_a_second_shows_a_bar(tmp_path, capsys, monkeypatch):
    import mapoffload._progress as progress

    model = _shards(tmp_path, 2)
    # A one-second delay is what the library uses; 0 makes "long" instant for the test.
    real = progress.byte_bar
    monkeypatch.setattr(progress, "byte_bar", lambda *a, **k: real(*a, **{**k, "delay": 0}))
    import mapoffload.loading.assign as assign  # where load_checkpoint's assignment makes its bar

    monkeypatch.setattr(assign, "byte_bar", progress.byte_bar)
    load_checkpoint(model, tmp_path, keep_mapping=False)
    assert "Assigning weights" in capsys.readouterr().err
    load_checkpoint(model, tmp_path, keep_mapping=False, progress=False)
    assert "Assigning weights" not in capsys.readouterr().err
