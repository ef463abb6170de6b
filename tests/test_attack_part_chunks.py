"""Hostile use of the layers' parts computed over chunks of their rows (issue 43, runtime._part_forward).

At depth 0 (test_part_chunks' SmallFirst stack: the window holds one 768 KiB ``big`` part) each plain
``nn.Linear`` part's forward is wrapped; its pre-hook arms a ``RowChunks`` and leaves the part's read to
the chunks. These tests replace the part's weight, give it a bias, call it on its own, run forwards on
two threads, remove or close the manager from inside a chunk, copy and pickle the model, record
autograd, replace a part's input from a user's pre-hook, fork, move the cap between forwards and turn
read-ahead off; on test_part_chunks' ``two_big`` stack (``up`` then ``down``, each the window) they attack
the read of ``down``'s first chunk behind ``up``'s last (``PartReads.read_next_head``): errors, close and
removal around it, weights replaced, forwards that skip ``down``, threads and a fork. The check's answer
is forced (``runtime._same_bits``) so that the chunks are taken on any CPU; outputs are compared bit for
bit with a plain model whose big parts compute over the same chunks by hand where the chunks are taken
(:func:`reference`), with the plain model where not.
"""

from __future__ import annotations

import copy
import io
import pathlib
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mapoffload import LayerwiseOffloadManager, drop_page_cache
from mapoffload.offload import runtime
from mapoffload.offload.hooks import OffloadedCopyError

from room_stack import Block, W, Stack
from room_stack import mapped as mapped_from
from stacks import save_reference
from fake_cgroups import fake_cap
from test_part_chunks import ROWS, depth_0
from test_part_readahead import BIG, BLOCKS, HEAD, IN_USE, MARGIN, SmallFirst

NAME = "small_first.safetensors"


@pytest.fixture
def cap(tmp_path, monkeypatch):
    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


@pytest.fixture
def exact(monkeypatch):
    """The check finds every kind of input exact: the chunks are taken on any CPU."""
    monkeypatch.setattr(runtime, "_same_bits", lambda a, b: True)


def plain_from(path, block_cls=SmallFirst, edit=None) -> nn.Module:
    from safetensors.torch import load_file

    ref = Stack(BLOCKS, HEAD, block_cls=block_cls)
    ref.load_state_dict({k: v.clone() for k, v in load_file(str(path)).items()})
    if edit is not None:
        with torch.no_grad():
            edit(ref)
    return ref


def chunk_by_hand(linear: nn.Linear) -> None:
    """``linear`` computes over chunks of ROWS rows by hand (as RowChunks does), its weight looked up at each call."""
    def forward(h, m=linear):
        return torch.cat([F.linear(h, m.weight[lo:lo + ROWS], None if m.bias is None else m.bias[lo:lo + ROWS])
                          for lo in range(0, m.weight.shape[0], ROWS)], -1)

    linear.forward = forward


def reference(path, chunked=range(BLOCKS), block_cls=SmallFirst, edit=None) -> nn.Module:
    """The plain model from ``path`` (edited by ``edit``), the big parts of the blocks in ``chunked`` by chunks."""
    ref = plain_from(path, block_cls, edit)
    for i in chunked:
        chunk_by_hand(ref.blocks[i].big)
    return ref


def run(ref, x):
    with torch.no_grad():
        return ref(x)


def rows_of(mgr) -> dict:
    """(layer, part) -> the RowChunks the stack cut for it (None: not chunked)."""
    return {key: rows for key, (_, rows) in mgr.parts.runtime._rows.items()}


def chunked_calls(mgr) -> int:
    return sum(r.chunked_calls for r in rows_of(mgr).values() if r is not None)


def part_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def first_of_their_geometry(model) -> list[int]:
    """The blocks whose big part's geometry (test_part_chunks: the weight's alignment) comes first: the
    first forward checks those (whole), and chunks the others (a verdict kept by geometry)."""
    seen, first = set(), []
    for i, block in enumerate(model.blocks):
        g = block.big.weight.data_ptr() % 64
        if g not in seen:
            seen.add(g)
            first.append(i)
    return first


def engaged(tmp_file_dir, cap, **kw):  # noqa: F811
    """depth_0's manager with hooks on, one forward run (the check: whole matmuls) and one chunked."""
    model, mgr, x, want = depth_0(tmp_file_dir, cap, **kw)
    path = tmp_file_dir / NAME
    mgr.register_forward_hooks()
    checked = first_of_their_geometry(model)
    with torch.no_grad():
        assert torch.equal(model(x), run(reference(path, [i for i in range(BLOCKS) if i not in checked]), x))
        assert torch.equal(model(x), run(reference(path), x))  # chunked
    assert chunked_calls(mgr) == 2 * BLOCKS - len(checked), rows_of(mgr)
    return model, mgr, x, want, path


# --- the part's weight replaced or written between forwards ---------------------------------------------


@pytest.mark.parametrize("how", ["parameter", "data", "in_place"])
def test_a_big_parts_weight_replaced_between_forwards(tmp_file_dir, cap, exact, how):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    torch.manual_seed(1)
    new = torch.randn(W, 3 * (W // 4))

    def edit(m):
        big = m.blocks[1].big
        if how == "parameter":
            big.weight = nn.Parameter(new.clone())
        elif how == "data":
            big.weight.data = new.clone()
        else:
            big.weight.mul_(2)

    with mgr:
        with torch.no_grad():
            edit(model)
        # A weight replaced is no longer the one the chunks were cut from: that part computes whole; one
        # written in place still is (the same mapping), and its chunks compute with what was written.
        chunked = range(BLOCKS) if how == "in_place" else [0, 2, 3]
        want_edited = run(reference(path, chunked, edit=edit), x)
        for _ in range(3):
            assert torch.equal(run(model, x), want_edited)
    assert not part_forwards(model)
    assert torch.equal(run(model, x), run(plain_from(path, edit=edit), x))


# --- a part with a bias ---------------------------------------------------------------------------------


class BiasFirst(SmallFirst):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(3 * (W // 4), W, bias=True)


def test_a_big_part_with_a_bias(tmp_file_dir, cap, exact):
    torch.manual_seed(0)
    path, x, want = save_reference(Stack(BLOCKS, HEAD, block_cls=BiasFirst), torch.randn(3, W), tmp_file_dir / NAME)
    drop_page_cache(str(path))
    part = BIG + W * 4
    cap(IN_USE + MARGIN + W * HEAD * 4 + part + part // 4)
    model = mapped_from(path, lambda: Stack(BLOCKS, HEAD, block_cls=BiasFirst))
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        plan = mgr.residency
        assert plan.parts and plan.depth == 0 and plan.window_bytes == part, plan.describe()
        mgr.register_forward_hooks()
        checked = first_of_their_geometry(model)
        assert torch.equal(run(model, x), run(reference(path, [i for i in range(BLOCKS) if i not in checked],
                                                         block_cls=BiasFirst), x))
        chunks = run(reference(path, block_cls=BiasFirst), x)
        for _ in range(2):
            assert torch.equal(run(model, x), chunks)
        assert chunked_calls(mgr) >= 2 * BLOCKS
    assert torch.equal(run(model, x), want)


# --- the part called on its own ----------------------------------------------------------------------


def test_a_big_part_called_on_its_own_computes_as_its_class(tmp_file_dir, cap, exact):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    big = model.blocks[1].big
    h = torch.randn(3, 3 * (W // 4))
    with mgr, torch.no_grad():
        before = chunked_calls(mgr)
        assert torch.equal(big(h), F.linear(h, big.weight))
        assert chunked_calls(mgr) == before  # a part called on its own is no layer's: not chunked
        assert torch.equal(model(x), run(reference(path), x))


def test_a_big_part_called_on_its_own_after_a_forward_interrupted_before_it(tmp_file_dir, cap, exact):
    """A user's pre-hook on the big part raises KeyboardInterrupt after the stack's pre-hook armed its
    chunks (torch runs no always-call hook for it). The part called on its own next is no layer's."""
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    big = model.blocks[1].big

    def interrupt(module, args):
        raise KeyboardInterrupt

    h = torch.randn(3, 3 * (W // 4))
    with mgr, torch.no_grad():
        handle = big.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        handle.remove()
        before = chunked_calls(mgr)
        assert torch.equal(big(h), F.linear(h, big.weight))
        # Regression: the RowChunks armed for the interrupted call stayed armed (only the wrapped forward
        # and the always-call post-hook took it; neither runs on a KeyboardInterrupt from a pre-hook), and
        # the part called on its own computed over the chunks, reading and letting go pages outside its
        # layer's turn. Now the armed chunks are taken only by the thread that armed them, inside the turn.
        assert chunked_calls(mgr) == before, "a part called on its own took the chunks armed for another call"
        assert torch.equal(model(x), run(reference(path), x))


# --- two threads ---------------------------------------------------------------------------------------


def two_threads(model, mgr, x, chunks) -> None:
    """Two threads run 6 forwards each at once: every output equals ``chunks``, nothing hangs or stays armed."""
    outcomes: list = []

    def loop():
        for _ in range(6):
            try:
                outcomes.append(torch.equal(run(model, x), chunks))
            except BaseException as e:  # noqa: BLE001
                outcomes.append(repr(e))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "hung"
    assert outcomes == [True] * 12, outcomes
    assert not mgr.parts.runtime._armed


def test_two_threads_running_forwards_at_once(tmp_file_dir, cap, exact):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    with mgr:
        two_threads(model, mgr, x, run(reference(path), x))
    assert torch.equal(run(model, x), want)


def test_a_big_part_called_on_its_own_by_another_thread_between_the_pre_hook_and_the_forward(tmp_file_dir, cap,
                                                                                            exact):
    """Thread B calls layer 1's big part on its own (no layer's turn) while thread A's forward is between the
    part's pre-hook (its chunks armed, its read left to them) and its forward."""
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    big = model.blocks[1].big
    h = torch.randn(3, 3 * (W // 4))
    seen = {}

    def other_thread(module, args):
        def call():
            with torch.no_grad():
                before = chunked_calls(mgr)
                seen["out"] = big(h)
                seen["chunked"] = chunked_calls(mgr) - before

        if threading.current_thread() is threading.main_thread() and "started" not in seen:
            seen["started"] = True  # once: B's own call runs this hook too
            seen["armed"] = set(mgr.parts.runtime._armed)
            t = threading.Thread(target=call, daemon=True)
            t.start()
            t.join(60)
            assert not t.is_alive(), "hung"
            seen["armed after"] = set(mgr.parts.runtime._armed)

    with mgr:
        handle = big.register_forward_pre_hook(other_thread)  # after the stack's own
        before = chunked_calls(mgr)
        got = run(model, x)
        handle.remove()
        assert torch.equal(seen["out"], F.linear(h, big.weight))
        # Regression: the armed chunks were keyed by (layer, part) only, shared by all threads: thread B's
        # call (its pre-hook a no-op: no turn) took the chunks thread A's pre-hook armed, computed over them
        # outside the layer's turn, and A's call computed whole from pages its pre-hook did not read (B's
        # always-call post-hook dropped them too). Now each thread takes and drops only its own.
        assert seen["armed"] == {(1, 3)}, seen  # A's chunks armed when B calls
        assert seen["armed after"] == seen["armed"], "another thread's call took the chunks armed for A's call"
        assert seen["chunked"] == 0 and chunked_calls(mgr) - before == BLOCKS, (seen, chunked_calls(mgr) - before)
        assert torch.equal(got, run(reference(path), x))


# --- remove or close from inside a chunk -------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "remove_forward_hooks"])
def test_remove_or_close_from_inside_a_chunk(tmp_file_dir, cap, exact, monkeypatch, how):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    real = F.linear
    big = model.blocks[1].big.weight
    done = []

    def linear(inp, weight, bias=None):
        if not done and weight.data_ptr() == big.data_ptr() and weight.shape[0] == ROWS:  # chunk 0, chunk 1 in flight
            done.append(1)
            getattr(mgr, how)()
        return real(inp, weight, bias)

    monkeypatch.setattr(F, "linear", linear)
    got = run(model, x)
    monkeypatch.setattr(F, "linear", real)
    assert done
    assert torch.equal(got, run(reference(path, [0, 1]), x))  # the chunks went on; the layers after, whole
    assert not part_forwards(model)
    assert torch.equal(run(model, x), want)
    if how == "close":
        # Regression: close() from inside a chunk stopped the page worker (PageWorker.close), then the
        # chunk's let-go started a new worker thread after the close. Now removing the hooks stops the
        # chunks (RowChunks.stop): those left compute on, asking nothing of the page worker.
        assert not mgr.parts.pages.worker.running, "a page worker thread started after close()"
    else:
        mgr.register_forward_hooks()
        for _ in range(2):
            assert torch.equal(run(model, x), run(reference(path), x))
        mgr.close()
        assert not mgr.parts.pages.worker.running
    assert torch.equal(run(model, x), want)


# --- copies ----------------------------------------------------------------------------------------------


def test_copies_and_pickles_are_refused_while_hooked_and_plain_after_close(tmp_file_dir, cap, exact):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    big = model.blocks[1].big
    assert "forward" in vars(big)
    for what in (model, model.blocks[1], big):
        with pytest.raises(OffloadedCopyError):
            copy.deepcopy(what)
        with pytest.raises(OffloadedCopyError):
            pickle.dumps(what)
        with pytest.raises(OffloadedCopyError):
            torch.save(what, io.BytesIO())
    with pytest.raises(OffloadedCopyError):
        pickle.dumps(big.forward)
    assert torch.equal(run(model, x), run(reference(path), x))  # still working after the refusals
    mgr.close()
    assert not part_forwards(model) and "forward" not in vars(big)
    for what in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert not part_forwards(what)
        assert torch.equal(run(what, x), want)
    part = copy.deepcopy(big)
    assert "forward" not in vars(part)
    h = torch.randn(3, 3 * (W // 4))
    assert torch.equal(part(h), F.linear(h, big.weight))


# --- autograd -----------------------------------------------------------------------------------------


def test_gradients_through_a_chunkable_part_are_the_plain_models(tmp_file_dir, cap, exact):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    ref = plain_from(path)
    with mgr:
        before = chunked_calls(mgr)
        for m in (model, ref):
            for p in m.parameters():
                p.requires_grad_(True)
                p.grad = None
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        with torch.enable_grad():
            outs = [m(xi) for m, xi in zip((model, ref), xs)]
            assert torch.equal(outs[0], outs[1])
            for o in outs:
                (o * o).sum().backward()
        assert chunked_calls(mgr) == before  # computed whole
        assert torch.equal(xs[0].grad, xs[1].grad)
        for i in range(BLOCKS):
            assert torch.equal(model.blocks[i].big.weight.grad, ref.blocks[i].big.weight.grad), i
        # and with no grad again: the chunks
        assert torch.equal(run(model, x), run(reference(path), x))


# --- a user's pre-hook that replaces the input ------------------------------------------------------


@pytest.mark.parametrize("kind", ["same", "other"])
def test_a_users_pre_hook_replaces_a_big_parts_input(tmp_file_dir, cap, exact, kind):
    """Registered after the stack's own (which decided whether to read the part from the input it saw)."""
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)

    def replace(module, args):
        h = args[0] * 2
        return (h,) if kind == "same" else (torch.cat([h, h], 0)[::2],)  # other strides: another kind

    with mgr:
        handle = model.blocks[1].big.register_forward_pre_hook(replace)
        ref_hooked = reference(path)
        ref_hooked.blocks[1].big.register_forward_pre_hook(replace)
        if kind == "same":
            for _ in range(2):
                assert torch.equal(run(model, x), run(ref_hooked, x))
        else:
            # The new kind is checked (the whole matmul returned), then chunked.
            first = reference(path, [0, 2, 3])
            first.blocks[1].big.register_forward_pre_hook(replace)
            assert torch.equal(run(model, x), run(first, x))
            for _ in range(2):
                assert torch.equal(run(model, x), run(ref_hooked, x))
        handle.remove()
        assert torch.equal(run(model, x), run(reference(path), x))


# --- fork -----------------------------------------------------------------------------------------------


def _fork_script(tmp_file_dir, tmp_path, build: str, reference: str, body: str) -> str:
    """A fork attack's child script: the fake cap, ``build`` (a stack of ``test_part_chunks``) made in
    ``tmp_file_dir`` with its hooks on, ``chunks`` the outputs of ``reference`` (the plain model computing
    in chunks), then ``body``."""
    return f"""
import os, pathlib, sys, torch
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})  # these tests, not a copy in the folder it runs from
from mapoffload.offload import runtime
from mapoffload.pagecache import coordinator as coordinator_module
from fake_cgroups import v2_cap
import test_attack_part_chunks as t
from test_part_chunks import {build}
from child import reap
runtime._same_bits = lambda a, b: True
root = {str(tmp_path / "cg")!r}
coordinator_module.CGROUP_ROOT = root
cap = lambda limit: v2_cap(root, int(limit), t.IN_USE, 0, 0)
files = pathlib.Path({str(tmp_file_dir)!r})
model, mgr, x, want = {build}(files, cap)
mgr.register_forward_hooks()
chunks = t.run({reference}, x)
""" + body


def forked_child(model, mgr, x, chunks, want, before=lambda: 0, after=lambda: 0) -> int:
    """A fork attack's child, its exit code (0: right): ``before()``, two forwards equal to ``chunks``,
    ``after()`` (each a code, 0 when right), then ``mgr`` closed and the model plain again (5 if not); 3: a
    forward differed, 4: it raised."""
    code = 0
    try:
        code = before()
        for _ in range(2):
            if not torch.equal(run(model, x), chunks):
                code = code or 3
        code = code or after()
        mgr.close()
        if part_forwards(model) or not torch.equal(run(model, x), want):
            code = code or 5
    except BaseException as e:
        print("child:", type(e).__name__, e, flush=True)
        code = 4
    return code


def _run_fork(script: str, tmp_path) -> None:
    """Run a fork attack's script; it prints ``child 0`` where the child exited cleanly."""
    from child import describe, run_python

    proc = run_python(script, timeout=120, env={"OMP_NUM_THREADS": "1",
                                                "MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB": str(MARGIN / (1 << 20)),
                                                "MAPOFFLOAD_PEERS_DIR": str(tmp_path / "peers")})
    assert proc.returncode == 0 and "child 0" in proc.stdout, describe(proc)


def test_a_forked_child_runs_a_forward_after_the_chunks_read(tmp_file_dir, tmp_path):
    _run_fork(_fork_script(tmp_file_dir, tmp_path, "depth_0", "t.reference(files / t.NAME)", """
t.run(model, x)
assert torch.equal(t.run(model, x), chunks)
calls = t.chunked_calls(mgr)
pid = os.fork()
if pid == 0:
    os._exit(t.forked_child(model, mgr, x, chunks, want,
                            after=lambda: 6 if t.chunked_calls(mgr) != calls + 2 * t.BLOCKS else 0))
code = reap(pid, 60)
assert torch.equal(t.run(model, x), chunks)
mgr.close()
assert not t.part_forwards(model)
print("child", code)
"""), tmp_path)


# --- the plan moving between forwards -----------------------------------------------------------------


def test_the_cap_moves_between_forwards_and_the_chunks_are_cut_again(tmp_file_dir, cap, exact):
    model, mgr, x, want, path = engaged(tmp_file_dir, cap)
    chunks = run(reference(path), x)
    room = IN_USE + MARGIN + W * HEAD * 4
    seen = []
    with mgr:
        for extra, chunked in ((2 * BIG + BIG // 4, False), (BIG + BIG // 4, True), (64 << 20, False),
                               (BIG + BIG // 4, True), (2 * BIG + BIG // 4, False), (BIG + BIG // 4, True)):
            cap(room + extra)
            for _ in range(2):
                before = chunked_calls(mgr)
                got = run(model, x)
                plan = mgr.residency
                seen.append((plan.unit, plan.depth))
                assert torch.equal(got, chunks if chunked else want), (extra, plan.describe())
                assert (chunked_calls(mgr) > before) == chunked, (extra, plan.describe())
        assert not mgr.parts.runtime._armed
    assert len(set(seen)) >= 3, seen
    assert not part_forwards(model)


def test_without_read_ahead_nothing_is_chunked_whatever_the_cap(tmp_file_dir, cap, exact):
    model, mgr, x, want = depth_0(tmp_file_dir, cap, prefetch_layers=0)
    mgr.register_forward_hooks()
    with mgr:
        for extra in (BIG + BIG // 4, BIG + BIG // 8, 2 * BIG + BIG // 4, BIG + BIG // 4):
            cap(IN_USE + MARGIN + W * HEAD * 4 + extra)
            for _ in range(2):
                assert torch.equal(run(model, x), want)
        assert chunked_calls(mgr) == 0 and not mgr.parts.runtime._armed


# --- the next part's first chunk read behind the last chunk of the part before (two_big: up, then down) ---


HEAD_OF = "layer {i} (blocks.{i}.down) (its first chunk)"


@pytest.fixture
def reads(monkeypatch):
    """The page worker's reads as they begin (test_part_readahead's ``ReadWatch``)."""
    from test_part_readahead import ReadWatch

    return ReadWatch(monkeypatch)


def two_big_engaged(tmp_file_dir, cap):
    """test_part_chunks' two_big stack, hooks on, one forward run (the checks, the order learnt) and one chunked
    (each ``up``'s last chunk reading ``down``'s first behind it)."""
    from test_part_chunks import two_big

    model, mgr, x, want = two_big(tmp_file_dir, cap)
    path = tmp_file_dir / "two_big.safetensors"
    mgr.register_forward_hooks()
    run(model, x)  # the first of each geometry checked (whole), the others chunked
    before = chunked_calls(mgr)
    assert torch.equal(run(model, x), run(two_big_reference(path), x))
    assert chunked_calls(mgr) - before == 2 * BLOCKS, rows_of(mgr)
    return model, mgr, x, want, path


def by_rows(linear: nn.Linear, rows: int) -> None:
    """``linear`` computes over chunks of ``rows`` rows by hand, its weight looked up at each call."""
    def forward(h, m=linear):
        return torch.cat([F.linear(h, m.weight[lo:lo + rows]) for lo in range(0, m.weight.shape[0], rows)], -1)

    linear.forward = forward


def two_big_reference(path, chunked=range(BLOCKS), edit=None) -> nn.Module:
    """The plain two_big model (edited by ``edit``), ``up`` and ``down`` of the blocks in ``chunked`` computed
    over their chunks (half the window each: W rows of ``up``, W / 2 of ``down``) by hand."""
    from safetensors.torch import load_file

    ref = Stack(BLOCKS, HEAD)
    ref.load_state_dict({k: v.clone() for k, v in load_file(str(path)).items()})
    drop_page_cache(str(path))  # what load_file read is not the manager's to count
    if edit is not None:
        with torch.no_grad():
            edit(ref)
    for i in chunked:
        by_rows(ref.blocks[i].up, W)
        by_rows(ref.blocks[i].down, W // 2)
    return ref


def is_last_chunk_of_up(model, weight, i=None) -> bool:
    blocks = model.blocks if i is None else [model.blocks[i]]
    return any(weight.data_ptr() == b.up.weight[W:].data_ptr() and weight.shape[0] == W for b in blocks)


def is_first_chunk_of_down(model, weight, i=None) -> bool:
    blocks = model.blocks if i is None else [model.blocks[i]]
    return any(weight.data_ptr() == b.down.weight.data_ptr() and weight.shape[0] == W // 2 for b in blocks)


def left_nothing(mgr) -> None:
    """Nothing read ahead outstanding, nothing of the streamed layers left in the page cache (edges aside)."""
    from test_part_readahead import EDGES, resident

    mgr.parts.pages.settle()
    assert not mgr.parts.pages.parts.reading_ahead, mgr.parts.pages.parts._ahead
    assert not mgr.parts.pages.parts._head_only
    assert resident(mgr) <= EDGES, resident(mgr)


@pytest.mark.slow  # the fast part stays within 5 minutes (README)
@pytest.mark.parametrize("where", ["up's last chunk", "down's first chunk"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_around_the_head_read_behind_the_last_chunk(tmp_file_dir, cap, exact, monkeypatch, reads, where,
                                                             error):
    """Raised in layer 1's ``up`` last chunk (``down``'s first chunk queued behind it), or in ``down``'s first
    chunk (its head taken from the reads ahead): nothing stays read ahead or resident, and later forwards compute
    the chunks' output."""
    model, mgr, x, want, path = two_big_engaged(tmp_file_dir, cap)
    real = F.linear
    hit = is_last_chunk_of_up if where == "up's last chunk" else is_first_chunk_of_down

    def linear(inp, weight, bias=None):
        if hit(model, weight, 1):
            assert reads(HEAD_OF.format(i=1)).wait(5)  # down's first chunk was queued (and began)
            raise error("inside a chunk")
        return real(inp, weight, bias)

    chunks = run(two_big_reference(path), x)
    with mgr:
        mgr.parts.pages.settle()
        monkeypatch.setattr(F, "linear", linear)
        with pytest.raises(error):
            run(model, x)
        monkeypatch.setattr(F, "linear", real)
        left_nothing(mgr)
        for _ in range(2):
            reads.clear()
            assert torch.equal(run(model, x), chunks)
            assert HEAD_OF.format(i=1) in reads.names, sorted(reads.names)  # still read behind up
            left_nothing(mgr)
    assert torch.equal(run(model, x), want)


@pytest.mark.parametrize("how", ["close", "remove_forward_hooks"])
def test_remove_or_close_from_inside_the_last_chunk_after_the_head_read(tmp_file_dir, cap, exact, monkeypatch, reads,
                                                                       how):
    model, mgr, x, want, path = two_big_engaged(tmp_file_dir, cap)
    real = F.linear
    done = []

    def linear(inp, weight, bias=None):
        if not done and is_last_chunk_of_up(model, weight, 1):
            assert reads(HEAD_OF.format(i=1)).wait(5)
            done.append(mgr.parts.pages.parts.reading_ahead)
            getattr(mgr, how)()
        return real(inp, weight, bias)

    monkeypatch.setattr(F, "linear", linear)
    got = run(model, x)
    monkeypatch.setattr(F, "linear", real)
    assert done == [True]
    # up's chunks of layers 0 and 1 and down's of layer 0 went on; the rest computes whole
    ref = two_big_reference(path, [0])
    by_rows(ref.blocks[1].up, W)
    assert torch.equal(got, run(ref, x))
    assert not mgr.parts.pages.parts.reading_ahead and not mgr.parts.pages.parts._head_only
    assert not mgr.parts.pages.parts._heads  # the chunked parts unregistered with the hooks
    if how == "close":
        assert not mgr.parts.pages.worker.running, "a page worker thread started after close()"
    else:
        mgr.register_forward_hooks()
        chunks = run(two_big_reference(path), x)
        for _ in range(2):
            reads.clear()
            assert torch.equal(run(model, x), chunks)
        assert HEAD_OF.format(i=1) in reads.names, sorted(reads.names)  # registered again with the hooks
        left_nothing(mgr)
        mgr.close()
        assert not mgr.parts.pages.worker.running
    assert torch.equal(run(model, x), want)


# --- the layer's stores changed between forwards ----------------------------------------------------------


@pytest.mark.parametrize("how", ["parameter", "data"])
def test_downs_weight_replaced_its_old_first_chunk_is_not_read(tmp_file_dir, cap, exact, reads, how):
    model, mgr, x, _, path = two_big_engaged(tmp_file_dir, cap)
    torch.manual_seed(1)
    new = torch.randn(W, 2 * W)

    def edit(m):
        if how == "parameter":
            m.blocks[1].down.weight = nn.Parameter(new.clone())
        else:
            m.blocks[1].down.weight.data = new.clone()

    ref = two_big_reference(path, [0, 2, 3], edit=edit)
    by_rows(ref.blocks[1].up, W)  # layer 1's up still computes over its chunks; down, replaced, whole
    want_edited = run(ref, x)
    with mgr:
        with torch.no_grad():
            edit(model)
        for _ in range(3):
            reads.clear()
            assert torch.equal(run(model, x), want_edited)
            assert HEAD_OF.format(i=1) not in reads.names, sorted(reads.names)  # the old weight's rows: not read
            assert HEAD_OF.format(i=2) in reads.names, sorted(reads.names)
            left_nothing(mgr)
    assert torch.equal(run(model, x), run(two_big_reference(path, [], edit=edit), x))


def test_a_layers_stores_changed_elsewhere_down_is_still_read_behind_up(tmp_file_dir, cap, exact, reads):
    """Layer 1's norm weight replaced (a mapped weight become owned: ``PartReads.forget(1)``): its ``up`` and
    ``down`` are the mappings they were, chunked as before; ``down``'s first chunk is still read behind ``up``'s
    last."""
    model, mgr, x, _, path = two_big_engaged(tmp_file_dir, cap)

    def edit(m):
        m.blocks[1].norm.weight = nn.Parameter(m.blocks[1].norm.weight.detach() * 2)

    chunks = run(two_big_reference(path, edit=edit), x)
    with mgr:
        with torch.no_grad():
            edit(model)
        for _ in range(3):
            reads.clear()
            assert torch.equal(run(model, x), chunks)
            left_nothing(mgr)
        # Regression: forget(1) dropped the first-chunk spans of all of layer 1's chunked parts, while the
        # runtime kept their RowChunks (the same step) and so never registered them again (_part_rows calls
        # PartReads.chunked only when it cuts new chunks): down's first chunk was never read ahead again.
        assert HEAD_OF.format(i=1) in reads.names, sorted(reads.names)


# --- the forward taking another way --------------------------------------------------------------------


class SkipsDown(Block):
    """room_stack's Block whose ``down`` is skipped while ``SkipsDown.skip`` holds its ``id``."""

    skip: frozenset = frozenset()

    def forward(self, x):
        h = torch.tanh(self.up(self.norm(x)))
        return x + (h[..., :W] if id(self) in SkipsDown.skip else self.down(h))


@pytest.mark.slow  # the fast part stays within 5 minutes (README)
def test_a_forward_that_skips_down_lets_its_first_chunk_go(tmp_file_dir, cap, exact, monkeypatch, reads):
    from room_stack import PART_BYTES
    from stacks import io_read_bytes
    from test_part_readahead import EDGES, resident

    monkeypatch.setattr(SkipsDown, "skip", frozenset())
    torch.manual_seed(0)
    path, x, _ = save_reference(Stack(BLOCKS, HEAD, block_cls=SkipsDown), torch.randn(3, W),
                                tmp_file_dir / "two_big.safetensors")
    drop_page_cache(str(path))
    cap(IN_USE + MARGIN + W * HEAD * 4 + PART_BYTES + PART_BYTES // 4)
    model = mapped_from(path, lambda: Stack(BLOCKS, HEAD, block_cls=SkipsDown))
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    assert mgr.residency.parts and mgr.residency.depth == 0 and mgr.residency.window_bytes == PART_BYTES

    def reference():
        ref = two_big_reference(path)
        for mine, theirs in zip(model.blocks, ref.blocks):
            if id(mine) in SkipsDown.skip:
                theirs.down.forward = lambda h: h[..., :W]
        return ref

    real = F.linear
    peaks = []

    def linear(inp, weight, bias=None):
        if is_first_chunk_of_down(model, weight) or is_last_chunk_of_up(model, weight):
            peaks.append(resident(mgr))
        return real(inp, weight, bias)

    with mgr:
        mgr.register_forward_hooks()
        for _ in range(3):
            run(model, x)  # the checks; the order learnt
        streamed = mgr.residency.streamed_bytes
        monkeypatch.setattr(F, "linear", linear)
        for skip in ([1], [], [0, 2], [0, 1, 2, 3], [], [3], []):
            SkipsDown.skip = frozenset(id(model.blocks[i]) for i in skip)
            want = run(reference(), x)
            reads.clear()
            mgr.parts.pages.settle()
            before = io_read_bytes()
            assert torch.equal(run(model, x), want), skip
            mgr.parts.pages.settle()
            read = io_read_bytes() - before
            assert read <= streamed + 2 * 4096 * 5 * BLOCKS, (skip, read, streamed)
            left_nothing(mgr)
            assert max(peaks) <= PART_BYTES + EDGES, (skip, peaks)
        monkeypatch.setattr(F, "linear", real)


@pytest.mark.slow  # the fast part stays within 5 minutes (README)
def test_two_threads_running_forwards_over_the_heads_read_ahead(tmp_file_dir, cap, exact):
    model, mgr, x, want, path = two_big_engaged(tmp_file_dir, cap)
    chunks = run(two_big_reference(path), x)
    with mgr:
        two_threads(model, mgr, x, chunks)
        left_nothing(mgr)
        assert torch.equal(run(model, x), chunks)
    assert torch.equal(run(model, x), want)


@pytest.mark.slow  # the fast part stays within 5 minutes (README)
def test_a_child_forked_inside_the_last_chunk_with_the_head_read_in_flight(tmp_file_dir, tmp_path):
    """The parent forks from inside layer 1's ``up`` last chunk, ``down``'s first chunk queued behind it: the
    child (its reads ahead the parent's, forgotten) finishes that forward and runs others, each right, and
    leaves nothing read ahead; so does the parent."""
    _run_fork(_fork_script(tmp_file_dir, tmp_path, "two_big", 't.two_big_reference(files / "two_big.safetensors")', """
import torch.nn.functional as F
for _ in range(2):
    t.run(model, x)
assert torch.equal(t.run(model, x), chunks)
real, forked = F.linear, []

def linear(inp, weight, bias=None):
    if not forked and t.is_last_chunk_of_up(model, weight, 1):
        assert mgr.parts.pages.parts.reading_ahead  # down's first chunk queued behind this one
        forked.append(os.fork())
    return real(inp, weight, bias)

F.linear = linear
got = t.run(model, x)
F.linear = real
if forked[0] == 0:
    def settled():
        mgr.parts.pages.settle()
        return 3 if not torch.equal(got, chunks) else 7 if mgr.parts.pages.parts.reading_ahead else 0
    os._exit(t.forked_child(model, mgr, x, chunks, want, before=settled))
code = reap(forked[0], 60)
assert torch.equal(got, chunks)
mgr.parts.pages.settle()
assert not mgr.parts.pages.parts.reading_ahead
assert torch.equal(t.run(model, x), chunks)
mgr.close()
print("child", code)
"""), tmp_path)
