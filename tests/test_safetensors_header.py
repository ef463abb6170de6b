"""Bad safetensors headers: inspect names the file and the key at fault and
never tracebacks; the loader refuses the same files with a CheckpointError."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import CheckpointError, load_checkpoint
from mapoffload.cli import main
from mapoffload.cli.inspect import read_safetensors_header

KEY = "layer.weight"


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def raw(header, data=b"\0" * 8, length=None):
    """A file: 8-byte little-endian header length, the header, the data."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


# (case id, file bytes, text the error must contain besides the file's path)
BAD = [
    ("header-list", raw([1, 2]), "JSON object"),
    ("header-number", raw(3), "JSON object"),
    ("header-string", raw("x"), "JSON object"),
    ("metadata-list", raw({"__metadata__": [1], KEY: entry()}), "__metadata__"),
    ("metadata-values", raw({"__metadata__": {"a": 1}, KEY: entry()}), "__metadata__"),
    ("entry-number", raw({KEY: 5}), KEY),
    ("dtype-unknown", raw({KEY: entry(dtype="F33")}), KEY),
    ("dtype-missing", raw({KEY: {"shape": [2], "data_offsets": [0, 8]}}), KEY),
    ("dtype-number", raw({KEY: entry(dtype=7)}), KEY),
    ("shape-number", raw({KEY: entry(shape=2)}), KEY),
    ("shape-negative", raw({KEY: entry(shape=[-2])}), KEY),
    ("shape-float", raw({KEY: entry(shape=[2.0])}), KEY),
    ("shape-bool", raw({KEY: entry(shape=[True, 2])}), KEY),
    ("offsets-one", raw({KEY: entry(offsets=[8])}), KEY),
    ("offsets-string", raw({KEY: entry(offsets=[0, "8"])}), KEY),
    ("offsets-reversed", raw({KEY: entry(offsets=[8, 0], shape=[0])}), KEY),
    ("offsets-negative", raw({KEY: entry(offsets=[-8, 0])}), KEY),
    ("offsets-past-the-data", raw({KEY: entry(offsets=[0, 8])}, data=b"\0" * 4), KEY),
    ("offsets-huge", raw({KEY: entry(offsets=[0, 2**70])}), KEY),
    ("nbytes-mismatch", raw({KEY: entry(shape=[3])}), KEY),
    ("duplicate-key", raw(b'{"%s": %s, "%s": %s}' % ((KEY.encode(), json.dumps(entry()).encode()) * 2)), KEY),
    ("deep-nesting", raw(b"[" * 100000 + b"]" * 100000), "JSON"),
    ("deep-nesting-in-entry", raw(b'{"%s": ' % KEY.encode() + b"[" * 100000 + b"]" * 100000 + b"}"), "JSON"),
    ("not-utf8", raw(b'{"\xff": 1}'), "JSON"),
    ("length-past-the-file", raw({KEY: entry()}, length=10_000), "header length"),
    ("length-huge", raw({KEY: entry()}, length=2**64 - 1), "header length"),
    ("too-short", b"abc", "too short"),
]


@pytest.fixture(params=BAD, ids=[b[0] for b in BAD])
def bad_file(request, tmp_path):
    name, content, expect = request.param
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(content)
    return path, expect


def test_header_reader_names_file_and_key(bad_file):
    path, expect = bad_file
    with pytest.raises(CheckpointError) as err:
        read_safetensors_header(str(path))
    assert str(path) in str(err.value) and expect in str(err.value)
    assert err.value.path == str(path)


def test_inspect_is_one_line_exit_2(bad_file, capsys):
    path, expect = bad_file
    assert main(["inspect", str(path)]) == 2  # any exception but the CLI's one line fails here
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and expect in err


def test_inspect_of_a_deeply_nested_header_as_a_user_runs_it(tmp_path):
    path = tmp_path / "deep.safetensors"
    path.write_bytes(raw(b"[" * 100000 + b"]" * 100000))
    r = subprocess.run([sys.executable, "-m", "mapoffload", "inspect", str(path)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and str(path) in r.stderr


def test_loader_refuses_the_same_files(bad_file):
    path, _ = bad_file
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(torch.nn.Linear(2, 1, bias=False), path, keep_mapping=True)
    assert str(path) in str(err.value)


def test_valid_headers_pass(tmp_path):
    path = tmp_path / "ok.safetensors"
    save_file({"a": torch.zeros(3, 2), "empty": torch.zeros(0, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, path,
              metadata={"format": "pt"})
    header = read_safetensors_header(str(path))
    assert header["__metadata__"] == {"format": "pt"}
    assert header["a"]["shape"] == [3, 2] and header["empty"]["shape"] == [0, 4]
