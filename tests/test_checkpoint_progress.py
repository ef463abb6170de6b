"""load_checkpoint shows a tqdm bar over the files of a sharded checkpoint
(when tqdm is installed), and none with progress=False."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tqdm")

from safetensors.torch import save_file  # noqa: E402

from mapoffload import load_checkpoint  # noqa: E402


def _three_shards(folder):
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    for i in range(3):
        save_file({f"{i}.weight": model[i].weight.detach().clone(), f"{i}.bias": model[i].bias.detach().clone()},
                  str(folder / f"part-{i}.safetensors"))
    return model


def test_bar_over_shards_and_off_switch(tmp_path, capsys):
    model = _three_shards(tmp_path)
    load_checkpoint(model, tmp_path, keep_mapping=True)
    err = capsys.readouterr().err
    assert "Loading checkpoint" in err and "/3 " in err  # a bar over the three files
    load_checkpoint(model, tmp_path, keep_mapping=True, progress=False)
    assert "Loading checkpoint" not in capsys.readouterr().err
