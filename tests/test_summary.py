"""``handle.summary()`` / ``handle.rows``: every number checked against an
independent measure (the checkpoint's own header for the sizes, and the test's
own reading of ``/proc/self/maps`` for which tensors lie on the file's mapping;
the summary itself asks ``MappedRegions().span_classes``), every word true for
the store and device in use, ≤ 100 columns."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import mapoffload
from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
from mapoffload._log import format_bytes
from mapoffload.hf._summary import stack_row
from mapoffload.hf.diffusers import offload_pipeline
from models import TinyModel, saveable_state


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "tiny.safetensors"
    save_file(saveable_state(TinyModel(width=32, layers=3)), path)
    return path


def _load(path, keep_mapping=True):
    with empty_weights():
        model = TinyModel(width=32, layers=3)
    load_checkpoint(model, path, keep_mapping=keep_mapping)
    return model.eval()


def _header_bytes(path, prefix: str = "") -> int:
    """Bytes of the checkpoint's tensors named ``prefix...``, from its safetensors header (read here)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(e - b for k, v in header.items() if k != "__metadata__" and k.startswith(prefix)
               for b, e in [v["data_offsets"]])


def _file_ranges(path) -> list[tuple[int, int]]:
    """Address ranges of ``path``'s mappings in /proc/self/maps (read here), adjacent ones merged."""
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5] == real:
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _classes(tensors, path):
    """(mapped, anonymous) bytes of distinct tensors: mapped when every byte lies on a mapping of the
    checkpoint file ``path``, anonymous otherwise."""
    ranges = _file_ranges(path)
    unique = {}
    for t in tensors:
        assert t.is_contiguous()  # so nbytes is its whole extent
        unique[t.data_ptr(), t.nbytes] = t
    mapped = anonymous = 0
    for ptr, n in unique:
        if any(lo <= ptr and ptr + n <= hi for lo, hi in ranges):
            mapped += n
        else:
            anonymous += n
    return mapped, anonymous


def test_the_reference_measure(checkpoint):
    """The test's measure on what is known: the header's sizes (3 blocks of LayerNorm(32), Linear(32, 64)
    and Linear(64, 32), fp32: 3 x 4256 x 4 bytes; a 64 x 32 embedding), views of the mapping, copies."""
    assert _header_bytes(checkpoint, "blocks.") == 51072 and _header_bytes(checkpoint, "embed.") == 8192
    mapped = _load(checkpoint)
    copied = _load(checkpoint, keep_mapping=False)
    assert _classes(list(mapped.blocks.parameters()), checkpoint) == (51072, 0)
    assert _classes(list(copied.blocks.parameters()), checkpoint) == (0, 51072)
    w = mapped.embed.weight
    assert _classes([w, w, mapped.head.weight], checkpoint) == (8192, 0)  # one tensor (tied head), once
    assert _classes([mapped.position_ids], checkpoint) == (0, 16 * 8)  # a real buffer, not from the file


def _hosts(handle, unit):
    return [t for _, t in handle.managers[unit].iter_cpu_weights()]


def _outside(model):
    return [model.embed.weight, model.position_ids]  # the head is tied to the embedding


def _check_words(text):
    assert all(len(line) <= 100 for line in text.splitlines()), text
    for wrong in ("streamed to cpu", "pageable", "0 layers", "host_store='mapped'"):
        assert wrong not in text, (wrong, text)


def test_mapped_store_rows_match_the_measure(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:
        blocks, rest = handle.rows
        assert (blocks.unit, blocks.how, blocks.layers) == ("blocks", "in place", 3)
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"), checkpoint)
        assert blocks.anonymous_bytes == 0 and blocks.pinned_bytes == blocks.device_bytes == 0
        assert blocks.nbytes == blocks.mapped_bytes == _header_bytes(checkpoint, "blocks.")
        assert (rest.unit, rest.how, rest.layers) == ("rest", "placed", None)
        assert (rest.mapped_bytes, rest.anonymous_bytes) == _classes(_outside(model), checkpoint)
        assert rest.mapped_bytes == _header_bytes(checkpoint, "embed.")  # the tied head counted once
        assert rest.anonymous_bytes == 16 * 8  # position_ids: a real int64 buffer, not from the file
        text = handle.summary()
        _check_words(text)
        assert "views of the checkpoint's file mapping" in text and "nothing is copied" in text
        total = next(line for line in text.splitlines() if line.startswith("total"))
        assert total.split("  ")[0] == "total"
        assert format_bytes(blocks.mapped_bytes + rest.mapped_bytes) in total
        assert format_bytes(rest.anonymous_bytes) in total
        assert "a full host copy of these" in text
    assert handle.rows == [] and "closed" in handle.summary()


def test_copied_store_rows_say_anonymous(checkpoint):
    model = _load(checkpoint, keep_mapping=False)
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:
        blocks = handle.rows[0]
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == (0, _header_bytes(checkpoint, "blocks."))
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"), checkpoint)
        assert blocks.how == "in place" and blocks.read_per_forward == 0 and blocks.cached_bytes == 0
        text = handle.summary()
        _check_words(text)
        assert "the model's own tensors in anonymous memory" in text
        assert "no file pages to keep cached or re-read" in text
        assert "stays on the file mapping" in text and "(0 %)" in text


def test_mixed_store_after_an_update(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:
        name = "blocks.1.fc1.weight"
        handle.managers["blocks"].update_cpu_weights({name: torch.zeros(64, 32)})
        blocks = handle.rows[0]
        assert blocks.anonymous_bytes == 64 * 32 * 4
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"), checkpoint)
        assert blocks.mapped_bytes == _header_bytes(checkpoint, "blocks.") - _header_bytes(checkpoint, name)
        assert "part on the file mapping, part anonymous copies" in handle.summary()


def test_pageable_host_store_on_the_cpu_is_a_copy_asked_for(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks", host_store="pageable") as handle:
        blocks = handle.rows[0]
        assert blocks.mapped_bytes == 0
        assert blocks.anonymous_bytes == blocks.nbytes == _header_bytes(checkpoint, "blocks.")
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"), checkpoint)
        assert "host_store='pageable' asked" in handle.summary()


def test_cpu_twin_is_streamed_and_says_so(checkpoint):
    model = _load(checkpoint)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True) as mgr:
        row = stack_row("blocks", mgr, available=None, host_store_given=False)
        assert row.how == "streamed" and "CPU twin" in row.where
        hosts = [t for _, t in mgr.iter_cpu_weights()]
        assert (row.mapped_bytes, row.anonymous_bytes) == _classes(hosts, checkpoint)
        assert row.mapped_bytes + row.anonymous_bytes == _header_bytes(checkpoint, "blocks.")


def test_residency_under_a_cap_reports_the_bytes_read_each_forward(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:
        mgr = handle.managers["blocks"]
        plan = mgr.parts.replan(mgr.parts.layer_bytes(0) * 2)
        assert plan.streamed
        blocks = handle.rows[0]
        assert blocks.read_per_forward == plan.streamed_bytes > 0
        assert blocks.cached_bytes == plan.cached_bytes
        text = handle.summary()
        _check_words(text)
        assert f"{len(plan.streamed)} are re-read from the file every forward" in text
        assert "budget" not in text  # said in words, not jargon


def test_streamed_rest_counts_modules_and_placed_tensors_once(checkpoint):
    """The rest streamed to the device module by module (the CPU twin runs that path: on the CPU itself
    ``rest="stream"`` is refused, the page-cache plan streams the rest)."""
    twin = {"device": "cpu", "cpu_twin": True, "host_store": "mapped", "layers": "blocks", "rest": "stream"}
    model = _load(checkpoint)
    with mapoffload.offload(model, **twin) as handle:
        # Only a tied embedding outside the blocks: nothing to stream, it stays placed.
        assert [r.unit for r in handle.rows] == ["blocks", "rest", "buffers"] and "rest" not in handle.managers
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())  # untied: an anonymous copy
    with mapoffload.offload(model, **twin) as handle:
        blocks, rest, placed, buffers = handle.rows
        assert (rest.unit, rest.layers, rest.how) == ("rest", 2, "streamed")
        assert (rest.mapped_bytes, rest.anonymous_bytes) == _classes(_hosts(handle, "rest"), checkpoint)
        assert rest.mapped_bytes == rest.anonymous_bytes == _header_bytes(checkpoint, "embed.")
        assert (placed.unit, placed.layers, placed.how) == ("placed", None, "placed")
        assert placed.nbytes == placed.anonymous_bytes == 16 * 8  # position_ids
        weights = [blocks, rest, placed]
        everything = _hosts(handle, "blocks") + _hosts(handle, "rest") + [model.position_ids]
        assert sum(r.nbytes for r in weights) == sum(_classes(everything, checkpoint))
        assert sum(r.nbytes for r in weights) == _header_bytes(checkpoint) + 8192 + 16 * 8  # + the untied copy
        assert buffers.unit == "buffers" and buffers.mapped_bytes == 0
        text = handle.summary()
        assert all(len(line) <= 100 for line in text.splitlines()), text
        assert "rest: copied module by module into CPU buffers" in text and "2 modules" in text


class Pipe:
    """What offload_pipeline needs of a diffusers pipeline: ``components``."""

    def __init__(self, **components):
        self.components = components


def test_pipeline_rows_per_component(checkpoint):
    pipe = Pipe(text_encoder=_load(checkpoint), transformer=_load(checkpoint, keep_mapping=False),
                tokenizer="not a module")
    handle = offload_pipeline(pipe, device="cpu")
    try:
        rows = handle.rows
        assert {r.component for r in rows} == {"text_encoder", "transformer"}
        enc = [r for r in rows if r.component == "text_encoder"]
        dit = [r for r in rows if r.component == "transformer"]
        blocks = _header_bytes(checkpoint, "blocks.")
        assert (enc[0].unit, enc[0].mapped_bytes, enc[0].anonymous_bytes) == ("blocks", blocks, 0)
        assert (dit[0].unit, dit[0].mapped_bytes, dit[0].anonymous_bytes) == ("blocks", 0, blocks)
        text = handle.summary()
        _check_words(text)
        lines = text.splitlines()
        assert "text_encoder:" in lines and "transformer:" in lines
        assert "text_encoder.blocks: computes on the CPU" in text
        assert text.count("stay in the page cache") >= 1  # residency per component
    finally:
        handle.close()


@pytest.mark.cuda
def test_pinned_and_device_columns_on_cuda(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cuda", layers="blocks", host_store="pinned") as handle:
        blocks, rest = handle.rows
        assert blocks.how == "streamed" and blocks.pinned_bytes == blocks.nbytes and blocks.mapped_bytes == 0
        assert rest.device_bytes == sum(t.nbytes for t in {id(t): t for t in _outside(model)}.values())
        text = handle.summary()
        _check_words(text)
        assert "pinned" in text.splitlines()[0] and "on device" in text.splitlines()[0]
