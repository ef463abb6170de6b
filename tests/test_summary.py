"""``handle.summary()`` / ``handle.rows``: every number checked against an
independent measure (``MappedRegions().span_classes`` over the tensors), every
word true for the store and device in use, ≤ 100 columns."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import mapoffload
from mapoffload import LayerwiseOffloadManager, MappedRegions, empty_weights, load_checkpoint
from mapoffload._log import format_bytes
from mapoffload.hf._summary import stack_row
from mapoffload.hf.diffusers import offload_pipeline
from mapoffload.regions import tensor_extent
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


def _classes(tensors):
    """(mapped, anonymous) extent bytes of distinct tensors, measured by span_classes."""
    unique = list({(t.data_ptr(), tensor_extent(t)[1]): t for t in tensors}.values())
    mapped = anonymous = 0
    for t, cls in zip(unique, MappedRegions().span_classes(unique)):
        n = tensor_extent(t)[1]
        if cls == "file":
            mapped += n
        else:
            anonymous += n
    return mapped, anonymous


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
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"))
        assert blocks.anonymous_bytes == 0 and blocks.pinned_bytes == blocks.device_bytes == 0
        assert blocks.nbytes == blocks.mapped_bytes > 0
        assert (rest.unit, rest.how, rest.layers) == ("rest", "placed", None)
        assert (rest.mapped_bytes, rest.anonymous_bytes) == _classes(_outside(model))
        assert rest.anonymous_bytes == model.position_ids.nbytes  # a real buffer, not from the file
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
        assert blocks.mapped_bytes == 0
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"))
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
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"))
        assert blocks.mapped_bytes > 0
        assert "part on the file mapping, part anonymous copies" in handle.summary()


def test_pageable_host_store_on_the_cpu_is_a_copy_asked_for(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks", host_store="pageable") as handle:
        blocks = handle.rows[0]
        assert blocks.mapped_bytes == 0 and blocks.anonymous_bytes == blocks.nbytes
        assert (blocks.mapped_bytes, blocks.anonymous_bytes) == _classes(_hosts(handle, "blocks"))
        assert "host_store='pageable' asked" in handle.summary()


def test_cpu_twin_is_streamed_and_says_so(checkpoint):
    model = _load(checkpoint)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True) as mgr:
        row = stack_row("blocks", mgr, available=None, host_store_given=False)
        assert row.how == "streamed" and "CPU twin" in row.where
        assert (row.mapped_bytes, row.anonymous_bytes) == _classes([t for _, t in mgr.iter_cpu_weights()])


def test_residency_under_a_cap_reports_the_bytes_read_each_forward(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:
        mgr = handle.managers["blocks"]
        plan = mgr.replan(mgr.layer_bytes(0) * 2)
        assert plan.streamed
        blocks = handle.rows[0]
        assert blocks.read_per_forward == plan.streamed_bytes > 0
        assert blocks.cached_bytes == plan.cached_bytes
        text = handle.summary()
        _check_words(text)
        assert f"{len(plan.streamed)} are re-read from the file every forward" in text
        assert "budget" not in text  # said in words, not jargon


def test_streamed_rest_counts_modules_and_placed_tensors_once(checkpoint):
    model = _load(checkpoint)
    with mapoffload.offload(model, device="cpu", layers="blocks", rest="stream") as handle:
        # Only a tied embedding outside the blocks: nothing to stream, it stays placed.
        assert [r.unit for r in handle.rows] == ["blocks", "rest"] and "rest" not in handle.managers
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())  # untied: an anonymous copy
    with mapoffload.offload(model, device="cpu", layers="blocks", rest="stream") as handle:
        blocks, rest, placed = handle.rows
        assert (rest.unit, rest.layers, rest.how) == ("rest", 2, "in place")
        assert (rest.mapped_bytes, rest.anonymous_bytes) == _classes(_hosts(handle, "rest"))
        assert rest.mapped_bytes == rest.anonymous_bytes == model.embed.weight.nbytes
        assert (placed.unit, placed.layers, placed.how) == ("placed", None, "placed")
        assert placed.nbytes == placed.anonymous_bytes == model.position_ids.nbytes
        everything = _hosts(handle, "blocks") + _hosts(handle, "rest") + [model.position_ids]
        assert sum(r.nbytes for r in handle.rows) == sum(_classes(everything))
        text = handle.summary()
        _check_words(text)
        assert "rest: computes on the CPU" in text and "2 modules" in text


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
        assert enc[0].mapped_bytes > 0 and enc[0].anonymous_bytes == 0
        assert dit[0].mapped_bytes == 0 and dit[0].anonymous_bytes > 0
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
