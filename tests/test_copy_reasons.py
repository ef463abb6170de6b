"""One copy-reason type (issue 34): ``CopyReason`` keys ``LoadReport.copied``, compares and
serialises as the strings users saw before, and a decision's copies carry the decision's reason
whoever holds the bytes (ordinary tensors and fp8 codes and scales alike)."""

from __future__ import annotations

import json
import logging

import pytest

torch = pytest.importorskip("torch")

import mapoffload  # noqa: E402
from mapoffload import CopyReason, empty_weights, load_checkpoint  # noqa: E402
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB  # noqa: E402

from fp8_models import Stack, random_codes, random_scales  # noqa: E402
from models import TinyModel, saveable_state  # noqa: E402


def _fp8_checkpoint(path):
    """A Stack checkpoint whose projections are fp8 codes with [128, 128] block scales."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = Stack().to(torch.bfloat16)
    state = {}
    for name, t in ref.state_dict().items():
        if name.endswith(("up.weight", "down.weight")):
            rows, cols = t.shape
            state[name] = random_codes(t.shape, seed=len(state))
            state[name + "_scale_inv"] = random_scales((-(-rows // 128), -(-cols // 128)))
        else:
            state[name] = t.contiguous()
    save_file(state, str(path))
    return path


def _ordinary_checkpoint(path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(saveable_state(TinyModel()), str(path))
    return path


def _load(kind, path, keep_mapping):
    with empty_weights():
        model = Stack().to(torch.bfloat16) if kind == "fp8" else TinyModel()
    return load_checkpoint(model, str(path), keep_mapping=keep_mapping)


def test_the_reasons_are_the_strings_users_see():
    assert CopyReason.GATE == "copies fit (gate)" and CopyReason.ASKED == "keep_mapping=False"
    assert isinstance(CopyReason.DTYPE, str) and str(CopyReason.COLUMN_SLICE) == "column slice"
    assert f"{CopyReason.NOT_MAPPED}" == "not mapped" and "%s" % CopyReason.DEVICE == "device"
    copied = {CopyReason.GATE: 3}
    assert copied.get("copies fit (gate)") == 3 and set(copied) == {"copies fit (gate)"}
    assert json.loads(json.dumps(copied)) == {"copies fit (gate)": 3}
    assert CopyReason.of_decision("gate") is CopyReason.GATE
    assert CopyReason.of_decision("caller") is CopyReason.ASKED
    assert CopyReason.made_by("diffusers") is CopyReason.MADE_BY_DIFFUSERS
    assert CopyReason.initialised_by("transformers") == "initialised by transformers (not in the checkpoint)"
    assert all(r.words for r in CopyReason)
    import mapoffload.loading.checkpoint

    assert "CopyReason" in mapoffload.__all__ and mapoffload.loading.checkpoint.CopyReason is CopyReason


@pytest.mark.parametrize("kind", ["fp8", "ordinary"])
def test_a_gate_copy_carries_the_gates_reason_everywhere(tmp_path, kind, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mapoffload")
    path = (_fp8_checkpoint if kind == "fp8" else _ordinary_checkpoint)(tmp_path / f"{kind}.safetensors")
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "64")  # copies fit: the gate copies
    report = _load(kind, path, None)
    assert report.decided_by == "gate" and not report.keep_mapping
    assert (report.fp8_weights > 0) == (kind == "fp8")
    # Every byte the gate copied, fp8 codes and scales included, under the gate's one reason.
    assert report.copied == {CopyReason.GATE: report.bytes_copied} and report.bytes_copied > 0, report.copied
    assert all(type(r) is CopyReason for r in report.copied)
    assert "for copies fit (gate))" in str(report) and "keep_mapping=False" not in str(report)
    assert "for copies fit (gate))" in caplog.text  # the load's log line names the same reason


def test_the_same_reason_for_an_fp8_and_an_ordinary_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "64")
    fp8 = _load("fp8", _fp8_checkpoint(tmp_path / "fp8.safetensors"), None)
    ordinary = _load("ordinary", _ordinary_checkpoint(tmp_path / "plain.safetensors"), None)
    assert set(fp8.copied) == set(ordinary.copied) == {CopyReason.GATE}
    # The caller's copies: one reason too, the caller's.
    fp8 = _load("fp8", tmp_path / "fp8.safetensors", False)
    ordinary = _load("ordinary", tmp_path / "plain.safetensors", False)
    assert set(fp8.copied) == set(ordinary.copied) == {CopyReason.ASKED}
    assert fp8.copied[CopyReason.ASKED] == fp8.bytes_copied


def test_summary_names_the_loads_copies_by_the_same_reason(tmp_path, monkeypatch):
    from mapoffload import LayerwiseOffloadManager
    from mapoffload.hf._summary import stack_row

    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "64")
    with empty_weights():
        model = TinyModel()
    report = load_checkpoint(model, str(_ordinary_checkpoint(tmp_path / "plain.safetensors")))
    model.mapoffload_report = report  # as from_pretrained leaves it
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        why = stack_row("blocks", mgr, available=None, host_store_given=False).why
    assert "the model's own tensors in anonymous memory" in why
    assert f"because {CopyReason.GATE.words} (copied['copies fit (gate)'])" in why, why


def test_a_report_pickles_with_its_reasons(tmp_path, monkeypatch):
    import pickle

    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "64")
    report = _load("fp8", _fp8_checkpoint(tmp_path / "fp8.safetensors"), None)
    back = pickle.loads(pickle.dumps(report))  # by the name users import it by: mapoffload.LoadReport
    assert back == report and type(back) is mapoffload.LoadReport
    assert list(back.copied) == [CopyReason.GATE] and type(next(iter(back.copied))) is CopyReason
