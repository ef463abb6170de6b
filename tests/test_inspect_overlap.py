"""A safetensors header whose tensors' byte ranges overlap (issue 36): every
loader refuses the file, so ``mapoffload inspect`` must too, and say which two
tensors overlap. Both read headers through one reader
(``mapoffload.loading.header.read_safetensors_header``), which checks the
layout safetensors' own loader requires: no overlap, no bytes between the
tensors or after the last. Its verdict is checked against safetensors'
``safe_open`` on each file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

from mapoffload import CheckpointError, load_checkpoint
from mapoffload.cli import main
from mapoffload.loading.header import read_safetensors_header


def _entry(begin, end, dtype="F32"):
    n = (end - begin) // 4
    return {"dtype": dtype, "shape": [n], "data_offsets": [begin, end]}


def _write(path, header, data_bytes):
    """8-byte little-endian header length, the JSON header, the data."""
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * data_bytes)
    return path


# (case id, header, data bytes, words the error must hold besides the file's path; None: valid)
CASES = [
    ("overlap", {"first.weight": _entry(0, 16), "second.weight": _entry(8, 24)}, 24,
     ["first.weight", "second.weight", "overlap"]),
    ("same-range", {"a": _entry(0, 16), "b": _entry(0, 16)}, 16, ["'a'", "'b'", "overlap"]),
    ("inside", {"outer": _entry(0, 32), "inner": _entry(8, 16), "tail": _entry(32, 40)}, 40,
     ["outer", "inner", "overlap"]),
    ("overlap-listed-backwards", {"z.late": _entry(8, 24), "a.early": _entry(0, 16)}, 24,
     ["z.late", "a.early", "overlap"]),
    ("gap", {"a": _entry(0, 16), "b": _entry(24, 40)}, 40, ["belong to no tensor", "'a'", "'b'"]),
    ("lead", {"a": _entry(8, 24)}, 24, ["belong to no tensor", "start of the data"]),
    ("trailing", {"a": _entry(0, 16)}, 24, ["belong to no tensor", "8 bytes"]),
    ("no-tensors-but-data", {}, 8, ["belong to no tensor"]),
    ("contiguous", {"b": _entry(16, 32), "a": _entry(0, 16)}, 32, None),
    ("empty-at-a-boundary", {"a": _entry(0, 16), "e": _entry(16, 16), "b": _entry(16, 32)}, 32, None),
    ("empty-at-the-end", {"a": _entry(0, 16), "e": _entry(16, 16)}, 16, None),
    ("nothing", {"__metadata__": {"format": "pt"}}, 0, None),
]


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path):
    name, header, data, words = request.param
    return _write(tmp_path / f"{name}.safetensors", header, data), words


def _safetensors_refuses(path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
    except Exception:
        return True
    return False


def test_the_header_reader_refuses_what_safetensors_refuses(case):
    path, words = case
    assert _safetensors_refuses(path) == (words is not None)  # the loaders' own verdict on the file
    if words is None:
        read_safetensors_header(path)
        return
    with pytest.raises(CheckpointError) as err:
        read_safetensors_header(path)
    assert err.value.path == str(path)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_inspect_reports_the_overlap_as_an_error_naming_both_tensors(case, capsys):
    path, words = case
    rc = main(["inspect", str(path)])
    captured = capsys.readouterr()
    if words is None:
        assert rc == 0, captured.err
        return
    assert rc == 2, captured.out
    assert captured.err.count("\n") == 1 and str(path) in captured.err
    for w in words:
        assert w in captured.err, (w, captured.err)


def test_the_loader_refuses_it_with_the_same_words(tmp_path):
    path = _write(tmp_path / "overlap.safetensors", {"weight": _entry(0, 16), "bias": _entry(8, 16 + 8)}, 24)
    model = torch.nn.Linear(4, 1)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, path, keep_mapping=True)
    with pytest.raises(CheckpointError) as said:
        read_safetensors_header(path)
    assert str(err.value) == str(said.value) and "'weight'" in str(err.value) and "'bias'" in str(err.value)
