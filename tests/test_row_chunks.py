"""A head larger than the room, computed over chunks of its rows where that is exact (issue 43).

The stack of ``test_attack_room`` (3 blocks of 2 MiB parts, a 3 MiB head) under its tight fake cap: the
layers are read part by part, the head streamed with a window of one part (2 MiB), so its rows come in
chunks of 1 MiB (3 chunks), each read on the page worker while the one before computes. Whether the
chunks compute the whole matmul's bits is this machine's BLAS's matter: the first call of a kind of
input checks it. These tests force the check's answer where they test what follows from it, and then
compare with the chunked computation itself, so that they hold on every CPU kind.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from mapoffload import LayerwiseOffloadManager, drop_page_cache, resident_bytes
from mapoffload.offload import runtime

from stacks import io_read_bytes
from test_attack_room import HEAD_BYTES, IN_USE, KIB, MARGIN, MIB, W, checkpoint, mapped, plain, row_chunks, tight

CHUNK = MIB  # half the window (one 2 MiB part)
EDGES = 2 * 4 << 10  # a page at each end of the head may stay


def engaged(path, cap, x, want):
    """The manager, hooks on, after one forward (the head is streamed from the first forward on; the
    kind of ``x`` checked by it)."""
    drop_page_cache(str(path))  # written back: a dirty page is neither paged out nor dropped by a let-go
    cap(tight())
    model = mapped(path)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    mgr.register_forward_hooks()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    plan = mgr.residency
    assert plan.always_streamed and plan.window_bytes == 2 * CHUNK, plan.describe()
    rows = row_chunks(model.head)
    assert rows is not None and len(rows.chunks) == HEAD_BYTES // CHUNK, rows
    return model, mgr, rows


def by_chunks(head, h):
    """What the chunks compute: ``F.linear`` over 512 rows at a time."""
    w = head.weight
    per = CHUNK // (W * 4)
    return torch.cat([F.linear(h, w[lo:lo + per]) for lo in range(0, w.shape[0], per)], -1)


@pytest.fixture
def cap(tmp_path, monkeypatch):
    from fake_cgroups import fake_cap

    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


def test_where_the_check_finds_the_chunks_exact_they_read_the_head_once_two_chunks_at_a_time(
        tmp_file_dir, cap, monkeypatch, caplog):
    path, x, want = checkpoint(tmp_file_dir)
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, rows = engaged(path, cap, x, want)
    head = model.head.weight
    seen: list[int] = []
    real = F.linear

    def linear(inp, weight, bias=None):
        if weight.data_ptr() != head.data_ptr() or weight.shape[0] != head.shape[0]:  # a chunk of the head
            if head.data_ptr() <= weight.data_ptr() < head.data_ptr() + HEAD_BYTES:
                seen.append(sum(resident_bytes([head])))
        return real(inp, weight, bias)

    h = torch.randn(4, W)
    with mgr, torch.no_grad(), caplog.at_level(logging.INFO, logger="mapoffload"):
        first = model.head(h)  # the check: the whole matmul returned
        assert torch.equal(first, plain(path).head(h))
        assert "computes every bit of the whole one" in caplog.text, caplog.text
        drop_page_cache(str(path))
        monkeypatch.setattr(F, "linear", linear)
        before = io_read_bytes()
        for _ in range(2):
            got = model.head(torch.randn(4, W))
        read = (io_read_bytes() - before) / 2
        monkeypatch.setattr(F, "linear", real)
        assert rows.chunked_calls == 2
        h2 = torch.randn(4, W)
        got2 = model.head(h2)
        mgr.parts.pages.worker.drain()
        assert sum(resident_bytes([head])) <= EDGES  # let go after
        assert torch.equal(got2, by_chunks(model.head, h2))
    assert got.shape == (4, HEAD_BYTES // (W * 4))
    assert 0.9 * HEAD_BYTES <= read <= 1.1 * HEAD_BYTES, read / HEAD_BYTES
    # The chunk computing and the one read ahead: never more than the window.
    assert len(seen) == 2 * len(rows.chunks) and max(seen) <= 2 * CHUNK + EDGES, [s / MIB for s in seen]


def test_where_the_check_finds_them_inexact_the_head_computes_whole(tmp_file_dir, cap, monkeypatch, caplog):
    path, x, want = checkpoint(tmp_file_dir)
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: False)
    model, mgr, rows = engaged(path, cap, x, want)
    ref = plain(path)
    with mgr, torch.no_grad(), caplog.at_level(logging.INFO, logger="mapoffload"):
        for _ in range(3):
            assert torch.equal(model(x), want)
            h = torch.randn(2, 5, W)
            assert torch.equal(model.head(h), ref.head(h))
    assert rows.chunked_calls == 0 and set(rows.exact.values()) == {False}, rows.exact
    assert "does not compute the bits of the whole one" in caplog.text


def test_each_kind_of_input_is_checked_once(tmp_file_dir, cap, monkeypatch):
    path, x, want = checkpoint(tmp_file_dir)
    checks = []
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: checks.append(a.shape) or True)
    model, mgr, rows = engaged(path, cap, x, want)
    checks.clear()  # the forward's (the head's kind of (3, W), and the layers' parts')
    with mgr, torch.no_grad():
        for shape in [(3, W), (3, W), (1, 3, W), (3, W), (1, 3, W)]:
            model.head(torch.randn(shape))
        model.head(torch.randn(3, 2 * W)[:, :W])  # other strides: another kind
    # (3, W) was checked by the forward in engaged(); (1, 3, W) and the strided one here.
    assert len(rows.exact) == 3 and rows.chunked_calls == 4, (rows.exact, rows.chunked_calls)
    assert len(checks) == 2 * len(rows.chunks)  # each chunk's output against the whole one's columns


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_inside_a_chunk_leaves_nothing_read_ahead(tmp_file_dir, cap, monkeypatch, error):
    path, x, want = checkpoint(tmp_file_dir)
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, rows = engaged(path, cap, x, want)
    head = model.head.weight
    real = F.linear
    calls = []

    def linear(inp, weight, bias=None):
        if weight.shape[0] < head.shape[0] and head.data_ptr() <= weight.data_ptr() < head.data_ptr() + HEAD_BYTES:
            calls.append(1)
            if len(calls) == 2:
                raise error("inside the head's second chunk")
        return real(inp, weight, bias)

    with mgr, torch.no_grad():
        model.head(torch.randn(2, W))  # checked
        monkeypatch.setattr(F, "linear", linear)
        with pytest.raises(error):
            model.head(torch.randn(2, W))
        monkeypatch.setattr(F, "linear", real)
        assert sum(resident_bytes([head])) <= EDGES  # the chunk read ahead let go, nothing in flight
        assert torch.equal(model(x), want)


def test_a_call_that_records_autograd_computes_whole(tmp_file_dir, cap, monkeypatch):
    path, x, want = checkpoint(tmp_file_dir)
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)
    model, mgr, rows = engaged(path, cap, x, want)
    model.requires_grad_(False)
    ref = plain(path).requires_grad_(False)
    h = torch.randn(2, W)
    with mgr:
        with torch.no_grad():
            model.head(h)
            model.head(h)
        assert rows.chunked_calls == 1
        hg, rg = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
        model.head(hg).sum().backward()
        ref.head(rg).sum().backward()
    assert rows.chunked_calls == 1 and torch.equal(hg.grad, rg.grad)


def test_one_bit_off_in_the_last_chunk_is_found(tmp_file_dir, cap, monkeypatch):
    """The check compares every bit of every chunk: a chunk's matmul one ulp off in one element of the
    last chunk (what another blocking does) makes that kind compute whole."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr, rows = engaged(path, cap, x, want)
    head = model.head.weight
    last = rows.chunks[-1][0]
    real = F.linear

    def linear(inp, weight, bias=None):
        out = real(inp, weight, bias)
        if weight.data_ptr() == head[last:].data_ptr() and weight.shape[0] < head.shape[0]:
            out = out.clone()
            out.view(-1)[-1] = torch.nextafter(out.view(-1)[-1], torch.tensor(float("inf")))
        return out

    ref = plain(path)
    monkeypatch.setattr(F, "linear", linear)
    with mgr, torch.no_grad():
        for _ in range(3):
            h = torch.randn(2, 3, W)
            assert torch.equal(model.head(h), ref.head(h))
    assert rows.exact[rows.signature(h, head, None)] is False and rows.chunked_calls == 0, rows.exact


def test_streaming_started_afresh_keeps_what_the_checks_found(tmp_file_dir, cap, monkeypatch):
    """A new plan streams the head afresh (new hooks, new chunks): where a chunk has the same rows, what
    the checks found is kept, and no kind is checked twice (each check reads the head by its faults)."""
    path, x, want = checkpoint(tmp_file_dir)
    checks = []  # the columns of each whole output checked against: the head's, or a layer's part's
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: checks.append(b._base.shape[-1]) or True)
    model, mgr, rows = engaged(path, cap, x, want)
    head = model.head.weight.shape[0]
    with mgr, torch.no_grad():
        assert checks.count(head) == len(rows.chunks)  # the forward in engaged() checked (3, W)
        mgr.parts.outside.stream(False)
        assert "forward" not in vars(model.head)
        for _ in range(2):
            assert torch.equal(model(x), want)
        again = row_chunks(model.head)
        assert again is not rows and again.chunked_calls == 2
    assert checks.count(head) == len(rows.chunks)


def test_a_deeper_window_keeps_the_same_chunks(tmp_file_dir, cap):
    """The chunks are two to the one part (or layer) the window holds ``1 + depth`` of, not to the window:
    a plan whose depth moves keeps them (and what their checks found)."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr, rows = engaged(path, cap, x, want)
    step = mgr.residency.window_bytes // (1 + mgr.residency.depth)
    with mgr:
        outside = mgr.parts.outside
        outside.stream(False)
        outside.stream(True, HEAD_BYTES - 1, step)  # a larger window, that still does not hold the head
        deeper = row_chunks(model.head)
        assert [c[:2] for c in deeper.chunks] == [c[:2] for c in rows.chunks]
        assert deeper.exact is rows.exact


def test_calls_the_chunks_do_not_fit_compute_as_the_module_does(tmp_file_dir, cap):
    """Found by an attack on the first version: a weight whose data was replaced (the same Parameter)
    got the old chunks (its new rows left uninitialised); sparse, nested and functorch-wrapped inputs
    raised where ``nn.Linear`` computes; autocast reused an fp32 verdict. Each computes as the module
    does, and none takes the chunks."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr, rows = engaged(path, cap, x, want)
    h = torch.randn(3, W)
    with mgr, torch.no_grad():
        model.head(h)
        assert rows.chunked_calls == 1  # (3, W) was checked in engaged()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model.head(h), F.linear(h.bfloat16(), model.head.weight.bfloat16()))
        assert torch.allclose(model.head(h.to_sparse()), F.linear(h, model.head.weight), atol=1e-5)  # its own sums
        nested = torch.nested.nested_tensor([torch.randn(2, W), torch.randn(3, W)])
        assert torch.equal(model.head(nested)[1], F.linear(nested, model.head.weight)[1])
        w = model.head.weight
        assert torch.equal(torch.vmap(model.head)(h), torch.vmap(lambda r: F.linear(r, w))(h))
        assert rows.chunked_calls == 1
        bigger = torch.randn(rows.weight.shape[0] + 512, W)
        model.head.weight.data = bigger  # the same Parameter, other data
        assert torch.equal(model.head(h), F.linear(h, bigger))
        assert rows.chunked_calls == 1


def test_a_keyboard_interrupt_in_the_check_leaves_nothing_resident(tmp_file_dir, cap, monkeypatch):
    """Its traceback kept (as a REPL keeps ``sys.last_traceback``): the chunks' generator is closed
    anyway, so what it read ahead is let go."""
    path, x, want = checkpoint(tmp_file_dir)
    model, mgr, rows = engaged(path, cap, x, want)

    def same(a, b):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "_same_bits", same)
    kept = []
    with mgr, torch.no_grad():
        try:
            model.head(torch.randn(7, W))
        except KeyboardInterrupt as e:
            kept.append(e)
        assert sum(resident_bytes([model.head.weight])) <= EDGES


def test_the_kinds_checked_are_bounded(tmp_file_dir, cap, monkeypatch):
    """Each check reads the head twice; a prompt length a kind (a last-token slice's strides carry it):
    past ``MAX_KINDS`` kinds, a new one computes whole, unchecked."""
    path, x, want = checkpoint(tmp_file_dir)
    monkeypatch.setattr(runtime, "MAX_KINDS", 4)
    model, mgr, rows = engaged(path, cap, x, want)
    with mgr, torch.no_grad():
        for n in range(5, 12):
            h = torch.randn(1, n, W)[:, -1:, :]
            assert torch.equal(model.head(h), F.linear(h, model.head.weight))  # the whole matmul, as the module's
    assert len(rows.exact) == 4


@pytest.mark.parametrize("threads", [1, 2])
def test_a_head_whose_rows_are_not_a_multiple_of_the_chunk(tmp_file_dir, cap, threads):
    """1636 rows in chunks of 512: the last chunk has 100. Checked for real (no forced answer), on 1 and
    2 threads, one token and a batch of 2 x 7: every output is the whole matmul's, whatever this CPU's
    library answered, and the chunks ran where it answered exact."""
    from room_stack import Stack

    rows_n = 3 * 512 + 100
    make = lambda: Stack(3, rows_n)  # noqa: E731
    path, x, want = checkpoint(tmp_file_dir, make=make)
    drop_page_cache(str(path))
    cap(tight(W * rows_n * 4))
    model = mapped(path, make)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr, torch.no_grad():
            mgr.register_forward_hooks()
            assert torch.equal(model(x), want)
            rows = row_chunks(model.head)
            assert rows is not None and [c[1] - c[0] for c in rows.chunks] == [512, 512, 512, 100]
            for shape in [(1, W), (2, 7, W)]:
                for _ in range(2):
                    h = torch.randn(shape)
                    assert torch.equal(model.head(h), F.linear(h, model.head.weight)), shape
            assert rows.chunked_calls == sum(rows.exact.values()) - rows.exact[rows.signature(x, model.head.weight,
                                                                                              None)]
    finally:
        torch.set_num_threads(before)


def _mapped_linear(tmp_file_dir, rows_: int, cols: int):
    """A bias-free linear of ``rows_ x cols`` whose weight is a view of a safetensors file, placed after
    another tensor so that it starts inside a 2 MiB folio of the file; and the file's path."""
    from safetensors.torch import save_file

    from mapoffload import load_checkpoint

    path = tmp_file_dir / "w.safetensors"
    save_file({"a": torch.randn(1000), "weight": torch.randn(rows_, cols)}, str(path))
    head = torch.nn.Linear(cols, rows_, bias=False, device="meta")
    load_checkpoint(head, str(path), keep_mapping=True, strict=False)
    return head, path


def _compute_in_chunks(rows, path, monkeypatch, also=None) -> list[int]:
    """``rows``' chunks computed from a cold weight advised as the manager advises it; the weight's resident
    bytes at each chunk's matmul returned (``also(weight)`` called there too). Checked: the chunks' outputs,
    and nothing left resident after but the weight's two 4 KiB ends."""
    from mapoffload.pagecache.pages import layer_spans

    w = rows.weight
    drop_page_cache(str(path))
    rows.worker.advise(layer_spans([(w.data_ptr(), w.nbytes)]))  # as the manager does: no readahead, 2 MiB folios
    seen: list[int] = []
    real = F.linear

    def linear(inp, weight, bias=None):
        seen.append(sum(resident_bytes([w])))
        if also is not None:
            also(weight)
        return real(inp, weight, bias)

    x = torch.randn(3, w.shape[1])
    monkeypatch.setattr(F, "linear", linear)
    got = torch.cat([part for _, _, part in rows.parts(x, w, None)], -1)
    monkeypatch.setattr(F, "linear", real)
    rows.worker.drain()
    assert sum(resident_bytes([w])) <= 2 * 4 * KIB, "let go after"
    assert torch.equal(got, torch.cat([real(x, w[lo:hi]) for lo, hi, *_ in rows.chunks], -1))
    return seen


def test_chunks_of_two_folios_or_more_are_read_and_let_go_at_the_file_s_folio_boundaries(tmp_file_dir, monkeypatch):
    """Chunks of at least two 2 MiB folios are read by whole folios of the file: a chunk's read ends at the
    folio boundary after its last row (taking the next chunk's first rows), its let-go at the one before,
    so that only the weight's two ends are read as 4 KiB pages (cut at the rows, each chunk's two ends
    were: up to 4 MiB of them a chunk, at 5-10x the kernel CPU a byte of a folio's). What a chunk computes
    with is resident when it computes, two chunks and two folios at most, and nothing after."""
    from mapoffload.pagecache.file_places import MapsView
    from mapoffload.pagecache.mapped_file import MappedFiles
    from mapoffload.pagecache.pages import FOLIO_BYTES, PageWorker

    head, path = _mapped_linear(tmp_file_dir, 4096 + 100, 1024)  # 16.4 MiB, rows of 4 KiB; the last chunk short
    w = head.weight
    cols = w.shape[1]
    maps, worker = MapsView(), PageWorker()
    off = maps.place(w.data_ptr()).offset
    assert off % FOLIO_BYTES, "the weight should start inside a folio"
    step = 2 * (4 * MIB + FOLIO_BYTES)  # chunks of 4 MiB (1024 rows): two of them and two folios in the step
    rows = runtime.RowChunks.of(head, "w", [w.data], worker, MappedFiles(), maps, step)
    assert rows is not None and [c[:2] for c in rows.chunks] == [(0, 1024), (1024, 2048), (2048, 3072),
                                                                 (3072, 4096), (4096, 4196)]
    start, end, row = w.data_ptr(), w.data_ptr() + w.nbytes, cols * 4

    def one(spans):
        assert len(spans) <= 1
        return (spans.addrs[0], spans.addrs[0] + spans.sizes[0]) if len(spans) else None

    reads = [one(c[2][0]) for c in rows.chunks]
    gone = [one(c[3][0]) for c in rows.chunks]
    # The reads cover the weight once, in order; so do the let-gos; inside it, both cut at folio boundaries.
    assert reads[0][0] == start and gone[0][0] == start and reads[-1] is None and gone[-1][1] == end
    assert [r for r in reads if r][-1][1] == end
    for a, b in zip([r for r in reads if r], [r for r in reads if r][1:]):
        assert a[1] == b[0] and (off + a[1] - start) % FOLIO_BYTES == 0
    for a, b in zip(gone, gone[1:]):
        assert a[1] == b[0] and (off + a[1] - start) % FOLIO_BYTES == 0
    for j, (lo, hi, *_) in enumerate(rows.chunks):  # its rows: let go no earlier than it, read no later
        assert gone[j][0] <= start + lo * row and (reads[j] or reads[j - 1])[1] >= start + hi * row
    # Only the weight's two ends are 4 KiB pages: no chunk inside has edges.
    assert [len(c[2][2]) for c in rows.chunks] == [1, 0, 0, 1, 0]

    seen = _compute_in_chunks(rows, path, monkeypatch)
    assert max(seen) <= 2 * 4 * MIB + 2 * FOLIO_BYTES, [s / MIB for s in seen]
    worker.close()


def test_where_the_step_holds_more_chunks_more_are_read_ahead_within_it(tmp_file_dir, monkeypatch):
    """A step of three 4 MiB chunks and the folio the computing one shares with the one before: while a chunk
    computes the next two are read (the second's read has begun), and the page cache never holds more than
    the step (and the weight's two 4 KiB ends). The chunks' outputs are the same."""
    import threading

    from mapoffload.pagecache import pages
    from mapoffload.pagecache.file_places import MapsView
    from mapoffload.pagecache.mapped_file import MappedFiles
    from mapoffload.pagecache.pages import FOLIO_BYTES, PageWorker

    head, path = _mapped_linear(tmp_file_dir, 5 * 1024, 1024)  # 20 MiB in chunks of 1024 rows (4 MiB)
    w = head.weight
    worker = PageWorker()
    step = 3 * 4 * MIB + FOLIO_BYTES
    rows = runtime.RowChunks.of(head, "w", [w.data], worker, MappedFiles(), MapsView(), step)
    assert rows is not None and [c[1] - c[0] for c in rows.chunks] == [1024] * 5
    began: dict[str, threading.Event] = {}
    real_read = pages.read_in

    def read_in(spans, what="weights", *args, **kw):
        began.setdefault(what, threading.Event()).set()
        return real_read(spans, what, *args, **kw)

    monkeypatch.setattr(pages, "read_in", read_in)
    second_ahead = []

    def chunk_1_computes(weight):  # chunk 3's read has begun
        if weight.data_ptr() == w[1024].data_ptr():
            second_ahead.append(began.setdefault("w (rows 3072-4096)", threading.Event()).wait(5))

    seen = _compute_in_chunks(rows, path, monkeypatch, chunk_1_computes)
    assert second_ahead == [True]
    assert max(seen) <= step + 2 * 4 * KIB, [s / MIB for s in seen]
    worker.close()


def test_a_part_s_step_and_a_layer_s_step_cut_the_same_chunks(tmp_file_dir):
    """A run's first forwards replan: whole layers, then parts (the step from 58 MiB to 14 MiB, issue 43's
    model at four layers of room). The chunks were cut to half the step, so each replan cut them afresh and
    checked them afresh (the head read and computed twice). Now they are two folios wherever half the step
    holds that beside a folio: the same chunks, and what their checks found kept."""
    from mapoffload.pagecache.file_places import MapsView
    from mapoffload.pagecache.mapped_file import MappedFiles
    from mapoffload.pagecache.pages import FOLIO_BYTES, PageWorker

    head, _ = _mapped_linear(tmp_file_dir, 6 * 1024, 1024)  # 24 MiB: rows of 4 KiB
    worker, verdicts = PageWorker(), {}
    cut = [runtime.RowChunks.of(head, "w", [head.weight.data], worker, MappedFiles(), MapsView(), step, verdicts)
           for step in (58 * MIB, 14 * MIB, 6 * FOLIO_BYTES)]
    assert all(c is not None for c in cut)
    assert [[ch[:2] for ch in c.chunks] for c in cut] == [[(lo, lo + 1024) for lo in range(0, 6 * 1024, 1024)]] * 3
    assert cut[0].exact is cut[1].exact is cut[2].exact
    smaller = runtime.RowChunks.of(head, "w", [head.weight.data], worker, MappedFiles(), MapsView(), 3 * FOLIO_BYTES)
    assert smaller is not None and smaller.chunks[0][1] == 512  # half the step, where it does not hold two folios
    worker.close()
