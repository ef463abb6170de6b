"""Attacks on from_pretrained's driving of transformers' load and on its
conversion cache: damaged or colliding conversion folders, a fork during a
load, what an fp8-kept model gives back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mapoffload  # noqa: E402
from conformance_zoo import build  # noqa: E402
from mapoffload.hf import _converted  # noqa: E402
from mapoffload.hf.convert import convert_pretrained  # noqa: E402

IDS = torch.tensor([[1, 2, 3]])


def _same_as_transformers(cls, folder, model) -> bool:
    ref = cls.from_pretrained(folder).eval()
    with torch.no_grad():
        return torch.equal(ref(IDS).logits, model(IDS).logits)


def test_an_empty_manifest_is_replaced_not_converted_forever(tmp_path):
    # An empty manifest.json (what a crash leaves when the manifest was renamed into place
    # before it reached the disk) made every later load convert again and throw its result away.
    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = convert_pretrained(str(tmp_path / "m"))
    with open(os.path.join(first.conversion_dir, _converted.MANIFEST), "w"):
        pass
    second = convert_pretrained(str(tmp_path / "m"))
    assert not second.conversion_reused and second.converted_tensors == 4
    third = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert third.mapoffload_report.conversion_reused
    assert _same_as_transformers(cls, str(tmp_path / "m"), third)


@pytest.mark.parametrize("damage", ["truncated", "tensor-missing"])
def test_a_damaged_part_is_converted_again_not_a_failed_load(tmp_path, damage):
    from safetensors.torch import load_file

    cls, _ = build("mixtral", str(tmp_path / "m"))
    first = convert_pretrained(str(tmp_path / "m"))
    part = os.path.join(first.conversion_dir, "part-00000.safetensors")
    if damage == "truncated":  # e.g. an interrupted copy of the cache folder
        os.truncate(part, os.path.getsize(part) // 2)
    else:
        kept = {k: v.clone() for k, v in list(load_file(part).items())[1:]}
        _converted.write_safetensors(part, kept)
    model = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert not model.mapoffload_report.conversion_reused and model.mapoffload_report.converted_tensors == 4
    assert _same_as_transformers(cls, str(tmp_path / "m"), model)
    again = mapoffload.from_pretrained(cls, str(tmp_path / "m"), device=None)
    assert again.mapoffload_report.conversion_reused  # and the folder was repaired


def test_two_checkpoints_alike_but_for_their_weights_never_share_a_conversion(tmp_path):
    # Two fine-tunes of one model: same config, same file names and sizes; timestamps
    # normalised (an image layer, a tar, a nix store); one shared conversion root.
    cls, _ = build("mixtral", str(tmp_path / "a"))
    other = cls.from_pretrained(str(tmp_path / "a"))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.save_pretrained(str(tmp_path / "b"))
    shutil.copy(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    for name in os.listdir(tmp_path / "a"):
        for x in "ab":
            os.utime(tmp_path / x / name, ns=(10**18, 10**18))
    cache = str(tmp_path / "shared")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mapoffload.from_pretrained(cls, str(tmp_path / "a"), device=None, cache_dir=cache)
        b = mapoffload.from_pretrained(cls, str(tmp_path / "b"), device=None, cache_dir=cache)
    assert not b.mapoffload_report.conversion_reused
    assert _same_as_transformers(cls, str(tmp_path / "b"), b)
