"""At depth 0 the largest parts compute over chunks of their rows, each read while the one before computes.

The room holds one of a layer's largest parts (``test_part_readahead``'s SmallFirst blocks: three 128 KiB
projections, then one of 768 KiB), so nothing of the next part can be read while it computes: the read
and the compute took turns (issue 43). A plain ``nn.Linear`` part larger than half the window computes
over chunks of its rows (``runtime.RowChunks``, as the head does): its pre-hook leaves its read to the
chunks, each read on the page worker while the one before computes and let go after, within the window.
Where the chunks compute the whole matmul's bits is the matmul library's matter, checked once per kind
of input and weight geometry; these tests force the check's answer and compare with the same chunks
computed by hand, so that they hold on every CPU kind.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from mapoffload.offload import runtime

from fake_cgroups import fake_cap
from room_stack import PART_BYTES, W, Stack
from room_stack import mapped as mapped_from
from stacks import save_reference
from test_part_readahead import BIG, BLOCKS, EDGES, HEAD, IN_USE, MARGIN, ReadWatch, SmallFirst, resident, small_first

from mapoffload import LayerwiseOffloadManager, drop_page_cache

ROWS = W // 2  # a chunk: half the window (one largest part, BIG), in rows of 3 W / 4 floats
NAMES = {0: "layer {i} (blocks.{i}.big) (rows 0-256)", 1: "layer {i} (blocks.{i}.big) (rows 256-512)"}


@pytest.fixture
def cap(tmp_path, monkeypatch):
    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


def depth_0(tmp_file_dir, cap, **kw):
    model, mgr, x, want = small_first(tmp_file_dir, cap, BIG + BIG // 4, **kw)
    plan = mgr.residency
    assert plan.parts and plan.depth == 0 and plan.window_bytes == BIG, plan.describe()
    return model, mgr, x, want


def by_hand(model, x):
    """The model's output with each big part computed over the same chunks, by hand (no manager)."""
    from safetensors.torch import load_file

    ref = Stack(BLOCKS, HEAD, block_cls=SmallFirst)
    ref.load_state_dict({k: v.clone() for k, v in load_file(model.path).items()})
    for block in ref.blocks:
        w = block.big.weight.detach()
        block.big.forward = lambda h, w=w: torch.cat([F.linear(h, w[lo:lo + ROWS]) for lo in range(0, W, ROWS)], -1)
    with torch.no_grad():
        return ref(x)


def second_forward(model, mgr, x, want, reads, monkeypatch, linear=None):
    """With ``mgr``'s hooks: a first forward (the checks, whole matmuls returned; the order learnt), then a
    second with ``F.linear`` replaced by ``linear`` (None: kept) whose output and the reads begun in it are
    returned; afterwards nothing is left read ahead and the manager is closed."""
    real = F.linear
    with mgr, torch.no_grad():
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want)
        mgr.parts.pages.settle()
        reads.clear()
        monkeypatch.setattr(F, "linear", linear or real)
        got = model(x)
        monkeypatch.setattr(F, "linear", real)
        mgr.parts.pages.settle()
        assert not mgr.parts.pages.parts.reading_ahead  # nothing left read ahead after the forward
        return got, reads.names


@pytest.fixture
def reads(monkeypatch):
    """The page worker's reads as they begin (``ReadWatch``)."""
    return ReadWatch(monkeypatch)


def test_the_next_chunk_is_read_while_one_computes_and_the_part_is_read_once(tmp_file_dir, cap, monkeypatch, reads):
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, x, want = depth_0(tmp_file_dir, cap)
    model.path = str(tmp_file_dir / "small_first.safetensors")
    waited, peaks = [], []
    real = F.linear

    def linear(inp, weight, bias=None):
        for i, block in enumerate(model.blocks):
            if weight.data_ptr() == block.big.weight.data_ptr() and weight.shape[0] == ROWS:  # chunk 0 of layer i
                waited.append(reads(NAMES[1].format(i=i)).wait(5))  # chunk 1's read began before chunk 0 computes
                peaks.append(resident(mgr))
        return real(inp, weight, bias)

    got, names = second_forward(model, mgr, x, want, reads, monkeypatch, linear)
    assert torch.equal(got, by_hand(model, x))
    assert waited == [True] * BLOCKS, waited
    for i in range(BLOCKS):  # the big part read by its chunks, never whole
        assert f"layer {i} (blocks.{i}.big)" not in names and NAMES[0].format(i=i) in names, sorted(names)
    assert max(peaks) <= BIG + EDGES, peaks


def test_one_check_for_each_geometry_of_weight_not_for_each_part(tmp_file_dir, cap, monkeypatch):
    checks = []
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: checks.append(b._base.shape[-1]) or True)
    model, mgr, x, want = depth_0(tmp_file_dir, cap)
    geometries = {b.big.weight.data_ptr() % 64 for b in model.blocks}  # the rest of the geometry is the same
    with mgr, torch.no_grad():
        mgr.register_forward_hooks()
        for _ in range(3):
            model(x)
    assert checks == [W] * 2 * len(geometries), checks  # two chunks each, checked in the first forward only


def test_a_forward_finds_every_part_s_chunks_with_one_snapshot_of_the_mappings(tmp_file_dir, cap, monkeypatch):
    """The chunks' file places come from one ``/proc/self/maps`` snapshot a forward, not one a part."""
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, x, want = depth_0(tmp_file_dir, cap)
    views = []
    real = runtime.RowChunks.of.__func__

    def of(cls, module, name, tensors, worker, files, maps, *args, **kwargs):
        views.append(maps)
        return real(cls, module, name, tensors, worker, files, maps, *args, **kwargs)

    monkeypatch.setattr(runtime.RowChunks, "of", classmethod(of))
    with mgr, torch.no_grad():
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want)
        model(x)
    assert len(views) == BLOCKS and len({id(v) for v in views}) == 1, views  # found once, in the first forward


def test_where_the_chunks_are_not_exact_the_part_is_read_whole_and_computes_whole(tmp_file_dir, cap, monkeypatch,
                                                                                   reads):
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: False)
    model, mgr, x, want = depth_0(tmp_file_dir, cap)
    with mgr, torch.no_grad():
        mgr.register_forward_hooks()
        for _ in range(3):
            reads.clear()
            assert torch.equal(model(x), want)
    assert all(f"layer {i} (blocks.{i}.big)" in reads.names for i in range(BLOCKS)), sorted(reads.names)
    assert not any("rows" in name for name in reads.names), sorted(reads.names)


def test_without_read_ahead_the_parts_are_not_chunked(tmp_file_dir, cap, monkeypatch, reads):
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, x, want = depth_0(tmp_file_dir, cap, prefetch_layers=0)
    with mgr, torch.no_grad():
        mgr.register_forward_hooks()
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert not any("rows" in name for name in reads.names), sorted(reads.names)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_inside_a_chunk_leaves_nothing_read_or_in_flight(tmp_file_dir, cap, monkeypatch, error):
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, x, want = depth_0(tmp_file_dir, cap)
    model.path = str(tmp_file_dir / "small_first.safetensors")
    real = F.linear
    big = model.blocks[1].big.weight

    def linear(inp, weight, bias=None):
        if weight.data_ptr() == big.data_ptr() and weight.shape[0] == ROWS:  # chunk 0 of layer 1, chunk 1 in flight
            raise error("inside a chunk")
        return real(inp, weight, bias)

    with mgr, torch.no_grad():
        mgr.register_forward_hooks()
        model(x)
        monkeypatch.setattr(F, "linear", linear)
        with pytest.raises(error):
            model(x)
        monkeypatch.setattr(F, "linear", real)
        mgr.parts.pages.worker.drain()
        assert not mgr.parts.pages.parts.reading_ahead and resident(mgr) <= EDGES, resident(mgr)
        for _ in range(2):
            assert torch.equal(model(x), by_hand(model, x))
    assert not any("forward" in vars(m) for m in model.modules())  # the parts' forwards given back


def two_big(tmp_file_dir, cap):
    """``room_stack``'s blocks (a norm, then two 2 MiB projections, up and down) at depth 0: each projection
    is the window, each computes over two chunks of 1 MiB."""
    torch.manual_seed(0)
    path, x, want = save_reference(Stack(BLOCKS, HEAD), torch.randn(3, W), tmp_file_dir / "two_big.safetensors")
    drop_page_cache(str(path))
    cap(IN_USE + MARGIN + W * HEAD * 4 + PART_BYTES + PART_BYTES // 4)
    model = mapped_from(path, lambda: Stack(BLOCKS, HEAD))
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    plan = mgr.residency
    assert plan.parts and plan.depth == 0 and plan.window_bytes == PART_BYTES, plan.describe()
    return model, mgr, x, want


def test_the_first_chunk_of_the_next_part_is_read_behind_the_last_chunk_of_the_part_before(tmp_file_dir, cap,
                                                                                          monkeypatch, reads):
    """At depth 0 nothing of a part could be read while the part before it computed: now, as the last chunk of
    ``up`` computes, the first chunk of ``down`` (which ran after it the last time) is being read, within the
    window, and ``down`` reads the rest chunk by chunk."""
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, x, want = two_big(tmp_file_dir, cap)
    head = "layer {i} (blocks.{i}.down) (its first chunk)"
    began, peaks = [], []
    real = F.linear

    def linear(inp, weight, bias=None):
        for i, block in enumerate(model.blocks):
            up, down = block.up.weight, block.down.weight
            if weight.data_ptr() == up[W:].data_ptr() and weight.shape[0] == W:  # up's last chunk
                began.append(reads(head.format(i=i)).wait(5))  # down's first chunk read before it computes
            if weight.data_ptr() == down.data_ptr() and weight.shape[0] == W // 2:  # down's first chunk
                peaks.append(resident(mgr))
        return real(inp, weight, bias)

    got, names = second_forward(model, mgr, x, want, reads, monkeypatch, linear)
    assert began == [True] * BLOCKS, began
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for i in range(BLOCKS):  # down read by its chunks, never whole
        assert f"layer {i} (blocks.{i}.down)" not in names, sorted(names)
    assert max(peaks) <= PART_BYTES + EDGES, peaks


def test_the_next_layers_first_parts_are_read_behind_the_last_chunk_of_a_layer(tmp_file_dir, cap, monkeypatch,
                                                                            reads):
    """Behind ``down``'s last chunk, the last part of a layer, the next layer's first parts that fit the window
    beside it start reading (here its norm: ``up``'s first chunk does not fit beside the chunk computing),
    not only a next part of the same layer; the page cache holds no more than the window all along."""
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, x, want = two_big(tmp_file_dir, cap)
    began, peaks = [], []
    real = F.linear

    def linear(inp, weight, bias=None):
        for i, block in enumerate(model.blocks[:-1]):
            down = block.down.weight
            if weight.data_ptr() == down[W // 2:].data_ptr() and weight.shape[0] == W // 2:  # down's last chunk
                began.append(reads(f"layer {i + 1} (blocks.{i + 1}.norm)").wait(5))
                peaks.append(resident(mgr))
        return real(inp, weight, bias)

    got, names = second_forward(model, mgr, x, want, reads, monkeypatch, linear)
    assert began == [True] * (BLOCKS - 1), began
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert max(peaks) <= PART_BYTES + EDGES, peaks


def test_a_part_read_ahead_by_its_first_chunk_that_computes_whole_is_read_whole(tmp_file_dir, cap, monkeypatch,
                                                                               reads):
    """``down``'s chunks are found inexact (so it computes whole) while ``up``'s are exact: its first chunk,
    read behind ``up``'s last, is not all it gets: the whole part is read before it computes."""
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: b._base.shape[-1] == 2 * W)  # up's outputs only
    model, mgr, x, want = two_big(tmp_file_dir, cap)
    got, names = second_forward(model, mgr, x, want, reads, monkeypatch)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for i in range(BLOCKS):
        assert {f"layer {i} (blocks.{i}.down) (its first chunk)", f"layer {i} (blocks.{i}.down)"} <= names, sorted(names)
