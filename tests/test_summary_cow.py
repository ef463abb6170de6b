"""``summary()`` counts what the process really holds (issue 36).

A mapped weight written in place (``w.mul_(2)`` under ``no_grad``) turns the
pages it wrote into the process's own anonymous memory (copy-on-write): the
summary counts those bytes as anonymous, not mapped, checked against smaps
(``cow_report``, an independent measure). And a storage range is counted once
however many views reach it: a shorter view at the same address (``t`` and
``t[:10]``), a view inside another, two views that overlap.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import mapoffload
from mapoffload import cow_report, empty_weights, load_checkpoint
from mapoffload._log import format_bytes
from mapoffload.hf._summary import placed_row
from mapoffload.memory.regions import tensor_extent
from models import TinyModel, saveable_state

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PAGE = 4096


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama whose MLP weights are 1 MiB each (fp32 1024 x 256)."""
    folder = tmp_path_factory.mktemp("llama-cow")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return transformers.LlamaForCausalLM, str(folder)


def _row(handle, unit):
    return next(r for r in handle.rows if r.unit == unit)


def _pages_written(t):
    """``[lo, hi)``: the pages a write of every byte of ``t`` turns private (whole pages)."""
    addr, n = tensor_extent(t)
    return addr - addr % PAGE, -(-(addr + n) // PAGE) * PAGE


def _bytes_in(tensors, lo, hi):
    """Bytes of the tensors' extents (each distinct range once) inside ``[lo, hi)``: computed here."""
    ranges = {tensor_extent(t) for t in tensors if t.device.type == "cpu" and t.numel()}
    covered = set()
    for addr, n in ranges:
        covered.update(range(max(addr, lo), min(addr + n, hi)))
    return len(covered)


def test_a_weight_written_in_place_counts_as_anonymous(llama):
    cls, folder = llama
    model = mapoffload.from_pretrained(cls, folder, device="cpu", keep_mapping=True)
    handle = model.mapoffload_handle
    try:
        layers = [p for p in model.model.layers.parameters()]
        w = model.model.layers[0].mlp.up_proj.weight
        assert w.nbytes == 1 << 20 and mapoffload.MappedRegions().holds(w)
        before = _row(handle, "model.layers")
        assert before.anonymous_bytes == before.written_bytes == 0 and before.mapped_bytes == before.nbytes
        assert cow_report([w]).anonymous_bytes == 0
        with torch.no_grad():
            w.mul_(2)
        lo, hi = _pages_written(w)
        assert cow_report([w]).anonymous_bytes == hi - lo  # smaps: these pages, and only these, turned private
        want = _bytes_in(layers, lo, hi)  # w, and its neighbours' bytes in the pages at its ends
        assert w.nbytes <= want <= hi - lo
        after = _row(handle, "model.layers")
        assert after.anonymous_bytes == after.written_bytes == want, (after, want)
        assert after.mapped_bytes == before.mapped_bytes - want
        assert after.nbytes == before.nbytes and after.mapped_bytes + after.anonymous_bytes == after.nbytes
        text = handle.summary()
        assert all(len(line) <= 100 for line in text.splitlines()), text
        table = next(line for line in text.splitlines() if line.startswith("model.layers"))
        assert format_bytes(want) in table, text
        assert "written in place" in text and "as loaded" not in text, text
    finally:
        handle.close()


def test_a_page_two_units_share_is_counted_by_bytes_not_twice(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "tiny.safetensors"
    save_file(saveable_state(TinyModel(width=256, layers=2)), path)
    with empty_weights():
        model = TinyModel(width=256, layers=2)
    load_checkpoint(model, path, keep_mapping=True)
    with mapoffload.offload(model.eval(), device="cpu", layers="blocks") as handle:
        rest, blocks = _row(handle, "rest"), _row(handle, "blocks")
        assert blocks.anonymous_bytes == 0
        e = model.embed.weight  # 64 x 256 fp32, mapped, outside the stack; the blocks lie before it in the file
        with torch.no_grad():
            e[:8].zero_()  # 8 KiB: the pages it touches turn private
        lo, hi = _pages_written(e[:8])
        assert cow_report([e]).anonymous_bytes == hi - lo
        in_rest = _bytes_in([e, model.position_ids], lo, hi)
        in_blocks = _bytes_in(list(model.blocks.parameters()), lo, hi)  # a block tensor's tail shares a page
        assert in_rest >= 8 << 10 and in_rest + in_blocks <= hi - lo
        now_rest, now_blocks = _row(handle, "rest"), _row(handle, "blocks")
        assert now_rest.anonymous_bytes == rest.anonymous_bytes + in_rest
        assert now_rest.mapped_bytes == rest.mapped_bytes - in_rest and now_rest.nbytes == rest.nbytes
        assert now_blocks.anonymous_bytes == now_blocks.written_bytes == in_blocks
        assert now_blocks.mapped_bytes == blocks.mapped_bytes - in_blocks
        assert "written in place" in handle.summary()


# --- each storage range once ------------------------------------------------------------------


def test_a_shorter_view_at_the_same_address_is_counted_once():
    t = torch.arange(100, dtype=torch.float32)
    row = placed_row("placed", [t, t[:10]], [], CPU, "test")
    assert (row.nbytes, row.anonymous_bytes, row.mapped_bytes) == (400, 400, 0)
    row = placed_row("placed", [t[:10], t], [], CPU, "test")  # the shorter one first
    assert (row.nbytes, row.anonymous_bytes) == (400, 400)


def test_views_inside_or_across_each_other_count_their_union():
    t = torch.arange(100, dtype=torch.float32)
    assert placed_row("placed", [t, t[10:20]], [], CPU, "test").nbytes == 400  # inside
    assert placed_row("placed", [t[0:60], t[40:100]], [], CPU, "test").nbytes == 400  # overlapping
    assert placed_row("placed", [t[0:10], t[50:60]], [], CPU, "test").nbytes == 80  # apart: both, nothing between
    assert placed_row("placed", [t[0:10], t[10:20]], [], CPU, "test").nbytes == 80  # touching
    col = torch.zeros(8, 8)[:, 0]  # a column view spans its rows: extent 57 elements
    assert placed_row("placed", [col], [], CPU, "test").nbytes == tensor_extent(col)[1] == 57 * 4


def test_a_shorter_view_of_a_mapped_weight_is_counted_once(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "tiny.safetensors"
    save_file(saveable_state(TinyModel(width=32, layers=1)), path)
    with empty_weights():
        model = TinyModel(width=32, layers=1)
    load_checkpoint(model, path, keep_mapping=True)
    w = model.embed.weight
    row = placed_row("placed", [w, w[:10], w[3:5]], [], CPU, "test")
    assert (row.nbytes, row.mapped_bytes, row.anonymous_bytes) == (w.nbytes, w.nbytes, 0)
