"""Part by part, read ahead (issue 43): while a part computes, the next part's pages are being read.

A stack of 4 blocks, each a norm and four 1 MiB projections, and a tiny head, under a fake cgroup v2
cap that leaves the layers a little more than two of their parts (half a layer): the plan reads part by
part, one part ahead. The order of reads and computes (the next part's read begins on the page worker
before the part before it has finished computing), the reads per forward, the page cache never
holding more than the plan's window, outputs equal to the plain model's, and nothing read ahead left
in the page cache or in flight after a forward, an exception or a KeyboardInterrupt inside a part,
``close()``, or a fork with a read ahead in flight.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, drop_page_cache
from mapoffload.pagecache import pages as pages_module
from mapoffload.pagecache.residency import LAYER, PART, plan_shared

from fake_cgroups import fake_cap
from room_stack import W, Stack
from room_stack import mapped as mapped_from
from stacks import io_read_bytes, save_reference

MIB, KIB = 1 << 20, 1 << 10
BLOCKS, HEAD = 4, 8
PART_BYTES = W * W * 4  # each projection: 1 MiB
LAYER_BYTES = 4 * PART_BYTES + 2 * W * 4
IN_USE, MARGIN = 10 * MIB, 4 * MIB
EDGES = 2 * 4 * KIB * 5 * BLOCKS  # a page at each end of each part may stay (pages.inner_pages)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.a, self.b, self.c, self.d = (nn.Linear(W, W, bias=False) for _ in range(4))

    def forward(self, x):
        h = torch.tanh(self.b(self.a(self.norm(x))))
        return x + self.d(torch.tanh(self.c(h)))


class Model(Stack):
    def __init__(self) -> None:
        super().__init__(BLOCKS, HEAD, block_cls=Block)


@pytest.fixture
def ckpt(tmp_file_dir):
    torch.manual_seed(0)
    path, x, want = save_reference(Model(), torch.randn(3, W), tmp_file_dir / "model.safetensors")
    drop_page_cache(str(path))  # written back: a dirty page is neither paged out nor dropped by a let-go
    return path, x, want


@pytest.fixture
def cap(tmp_path, monkeypatch):
    return fake_cap(tmp_path, monkeypatch, margin=MARGIN, in_use=IN_USE)


def half_a_layer() -> int:
    """A cap that leaves the layers two parts and a quarter: part by part, one read ahead."""
    return IN_USE + MARGIN + W * HEAD * 4 + 2 * PART_BYTES + PART_BYTES // 4


def started(path, cap, **kw):
    cap(half_a_layer())
    model = mapped_from(path, Model)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", **kw)
    plan = mgr.residency
    assert plan.unit == PART and plan.depth == 1 and plan.window_bytes == 2 * PART_BYTES, plan.describe()
    assert "1 read ahead" in plan.describe()
    mgr.register_forward_hooks()
    return model, mgr


def resident(mgr) -> int:
    return sum(mgr.parts.pages.resident_bytes())


def test_the_depth_comes_from_the_room():
    sizes = [LAYER_BYTES] * BLOCKS
    # As deep as the room holds, one layer's worth (prefetch_layers=1: its four projections) at most.
    for room, depth in ((PART_BYTES, 0), (2 * PART_BYTES - 1, 0), (2 * PART_BYTES, 1), (3 * PART_BYTES, 2),
                        (LAYER_BYTES + 1 * PART_BYTES, 4), (2 * LAYER_BYTES - 1, 4)):
        plan = plan_shared([sizes], room, prefetch_layers=[1], parts=[PART_BYTES])[0]
        assert (plan.unit, plan.depth, plan.window_bytes) == (PART, depth, (1 + depth) * PART_BYTES), (room, plan)
        assert plan.window_layers == 1  # the uncached buffers a plan charges are layers: parts take none more
    # Two layers fit: whole layers, one read ahead.
    whole = plan_shared([sizes], 2 * LAYER_BYTES, prefetch_layers=[1], parts=[PART_BYTES])[0]
    assert (whole.unit, whole.depth) == (LAYER, 1)
    deep = plan_shared([sizes], 7 * PART_BYTES, prefetch_layers=[2], parts=[PART_BYTES])[0]
    assert deep.unit == PART and deep.depth == 6 and deep.window_bytes == 7 * PART_BYTES
    # The cached set's thin share of the margin (page cache the kernel can reclaim, watched) may hold
    # parts read ahead too; whole layers read ahead may not (their window may be anonymous buffers).
    thin = plan_shared([sizes], PART_BYTES, prefetch_layers=[1], parts=[PART_BYTES], cache_only=2 * PART_BYTES)[0]
    assert (thin.unit, thin.depth, thin.window_bytes) == (PART, 2, 3 * PART_BYTES), thin
    layers = plan_shared([sizes], LAYER_BYTES * 2 - 1, prefetch_layers=[1], parts=[0], cache_only=LAYER_BYTES)[0]
    assert (layers.unit, layers.depth) == (LAYER, 0), layers
    none = plan_shared([sizes], 3 * PART_BYTES, prefetch_layers=[0], parts=[PART_BYTES])[0]
    assert none.depth == 0 and not none.readahead  # prefetch_layers=0: nothing read ahead, parts either


class ReadWatch:
    """The page worker's reads as they begin (``pages.read_in`` patched through ``mp``): ``watch(name)`` is
    an Event set when the read of that name began (made on first ask), ``watch.names`` those begun."""

    def __init__(self, mp) -> None:
        self._began: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        real = pages_module.read_in

        def read_in(spans, what="weights", *args, **kw):
            self(what).set()
            return real(spans, what, *args, **kw)

        mp.setattr(pages_module, "read_in", read_in)

    def __call__(self, name: str) -> threading.Event:
        with self._lock:
            return self._began.setdefault(name, threading.Event())

    @property
    def names(self) -> set[str]:
        with self._lock:
            return {n for n, e in self._began.items() if e.is_set()}

    def clear(self) -> None:
        with self._lock:
            self._began.clear()


def test_the_next_parts_read_begins_before_the_part_before_it_has_computed(ckpt, cap, monkeypatch):
    """Each part's compute waits (in a hook after it) until the page worker has begun reading the part
    that runs next: without read-ahead that read begins only once the next part is about to run, and
    the wait times out."""
    path, x, want = ckpt
    began = ReadWatch(monkeypatch)
    model, mgr = started(path, cap)
    names = [f"layer {i} (blocks.{i}.{p})" for i in range(BLOCKS) for p in ("norm", "a", "b", "c", "d")]
    waited: list[tuple[str, bool]] = []
    watching = [False]

    def after(name):
        def hook(module, args, output):
            nxt = names.index(name) + 1
            if watching[0] and nxt < len(names) and not any(not ok for _, ok in waited):
                waited.append((names[nxt], began(names[nxt]).wait(5)))
        return hook

    handles = [getattr(model.blocks[i], p).register_forward_hook(after(f"layer {i} (blocks.{i}.{p})"))
               for i in range(BLOCKS) for p in ("norm", "a", "b", "c", "d")]
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)  # the order learnt
        mgr.parts.pages.settle()
        began.clear()
        watching[0] = True
        peaks = []
        handles += [getattr(model.blocks[i], p).register_forward_hook(lambda *a: peaks.append(resident(mgr)))
                    for i in range(BLOCKS) for p in ("a", "b", "c", "d")]
        assert torch.equal(model(x), want)
    for h in handles:
        h.remove()
    assert len(waited) == len(names) - 1 and all(ok for _, ok in waited), waited
    # The part computing and the one read ahead: never more than the plan's window in the page cache.
    assert max(peaks) <= 2 * PART_BYTES + EDGES, [p / MIB for p in peaks]


def test_a_part_read_ahead_and_taken_by_the_kernel_before_its_use_is_counted(ckpt, cap):
    """Parts read ahead may sit in the cached set's thin share: one the kernel took before it ran is
    counted as missing (the coordinator then gives the thin share back)."""
    from mapoffload.pagecache.pages import let_go

    path, x, want = ckpt
    model, mgr = started(path, cap)
    pages = mgr.parts.pages
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)  # the order learnt
        pages.take_missing()
        pages.watch = True
        taken = []

        def take_b(module, args, output):  # a computes; b was read ahead behind it: the kernel takes it
            if not taken:
                pages.parts._ahead[(1, 2)].result()
                let_go(pages.parts._part(1, 2)[0])
                taken.append(1)

        handle = model.blocks[1].a.register_forward_hook(take_b)
        assert torch.equal(model(x), want)
        handle.remove()
        assert pages.take_missing() >= PART_BYTES // 2
        assert torch.equal(model(x), want)
        assert pages.take_missing() == 0  # nothing taken: nothing counted


def test_a_forward_reads_each_byte_once_with_read_ahead(ckpt, cap):
    path, x, want = ckpt
    model, mgr = started(path, cap)
    with mgr, torch.no_grad():
        drop_page_cache(str(path))
        for _ in range(2):
            assert torch.equal(model(x), want)
        before = io_read_bytes()
        for _ in range(3):
            assert torch.equal(model(x), want)
        read = (io_read_bytes() - before) / 3
        streamed = mgr.residency.streamed_bytes
        assert 0.9 * streamed <= read <= 1.1 * streamed + EDGES, (read, streamed)
        assert resident(mgr) <= EDGES  # each part let go, the last read ahead (none: the forward's end) too
        assert not mgr.parts.pages.parts._ahead


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_error_inside_a_part_leaves_nothing_read_ahead(ckpt, cap, error):
    path, x, want = ckpt
    model, mgr = started(path, cap)
    calls = []

    def hook(module, args, output):
        if not calls:
            calls.append(1)
            raise error("inside a projection")

    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.blocks[1].b.register_forward_hook(hook)
        with pytest.raises(error):
            model(x)
        handle.remove()
        assert not mgr.parts.pages.parts._ahead  # the part read ahead of the one that raised: let go, not in flight
        assert resident(mgr) <= EDGES, (mgr.parts.pages.resident_bytes(), mgr.parts.pages.worker.let_go_counts)
        model.blocks[0](x)  # a layer on its own after the forward was left: it leaves nothing read ahead
        assert not mgr.parts.pages.parts._ahead and resident(mgr) <= EDGES
        for _ in range(2):
            assert torch.equal(model(x), want)


def test_a_forward_that_goes_another_way_lets_the_wrong_part_go(ckpt, cap):
    """The order learnt is a's then b's: a forward that skips b reads what runs on demand and lets the
    part it read ahead for nothing go; the page cache holds no more than the window all along."""
    path, x, want = ckpt
    model, mgr = started(path, cap)
    skip = [False]
    real = Block.forward

    def forward(self, x):
        if not skip[0]:
            return real(self, x)
        return x + self.d(torch.tanh(self.c(torch.tanh(self.a(self.norm(x))))))

    peaks, asked = [], []
    worker = type(mgr.parts.pages.worker)
    real_read, real_let_go = worker.read_in, worker.let_go
    with mgr, torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Block, "forward", forward)
        assert torch.equal(model(x), want)
        for i in range(BLOCKS):
            for p in ("a", "c", "d"):
                getattr(model.blocks[i], p).register_forward_hook(lambda *a: peaks.append(resident(mgr)))
        mp.setattr(worker, "read_in", lambda w, spans, what="weights", *a: (asked.append(what), real_read(
            w, spans, what, *a))[1])
        mp.setattr(worker, "let_go", lambda w, spans, *a: (asked.append(spans.addrs[0]), real_let_go(w, spans, *a))[1])
        skip[0] = True
        with torch.no_grad():
            plain_skip = model(x)
        skip[0] = False
        for i in range(BLOCKS):  # b's let-go asked before c's read on demand, which waits for it
            b = min(t.data_ptr() for t in model.blocks[i].b.parameters())
            assert asked.index(b) < asked.index(f"layer {i} (blocks.{i}.c)"), asked
        assert torch.equal(model(x), want)
        assert max(peaks) <= 2 * PART_BYTES + EDGES, [p / MIB for p in peaks]
        assert resident(mgr) <= EDGES
    reference = Model()
    reference.load_state_dict(model.state_dict())
    skip[0] = True
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Block, "forward", forward)
        assert torch.equal(plain_skip, reference(x))


def test_a_forward_patched_on_the_class_after_offloading_is_the_one_that_runs(ckpt, cap):
    """Found writing the test above: the layer's guarded forward held the bound method it wrapped, so
    a forward the user's code set on the class after the hooks (a patch of the model's code) never ran
    - a silent wrong output. It is looked up at each call now, as torch does."""
    path, x, want = ckpt
    model, mgr = started(path, cap)
    real = Block.forward

    def patched_forward(self, x):
        return real(self, x) * 2 - x

    reference = Model()
    with mgr, torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        reference.load_state_dict(model.state_dict())
        assert torch.equal(model(x), want)
        mp.setattr(Block, "forward", patched_forward)
        assert torch.equal(model(x), reference(x)) and not torch.equal(model(x), want)
    with torch.no_grad():
        assert torch.equal(model(x), want)


class Twice:
    """A callable object set on the class as its forward: Python gives it unbound (no ``__get__``)."""

    def __call__(self, x):
        return x * 2


@pytest.mark.parametrize("make", [staticmethod(lambda x: x * 3), Twice()], ids=["staticmethod", "callable"])
def test_a_class_forward_that_is_no_function_is_called_as_python_calls_it(ckpt, cap, make):
    """A review of the fix above: a staticmethod got the layer as its first argument (a wrong output),
    a callable object without ``__get__`` raised AttributeError."""
    path, x, want = ckpt
    model, mgr = started(path, cap)
    reference = Model()
    with mgr, torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        reference.load_state_dict(model.state_dict())
        assert torch.equal(model(x), want)
        mp.setattr(Block, "forward", make)
        assert torch.equal(model(x), reference(x))


def test_a_layer_called_on_its_own_leaves_nothing_read_ahead(ckpt, cap):
    """A review found the next layer's parts read ahead by a layer called on its own (not in a forward
    of the model) left in the page cache until the next forward; now let go as the layer returns."""
    path, x, want = ckpt
    model, mgr = started(path, cap)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        model.blocks[0](x)
        assert not mgr.parts.pages.parts._ahead and resident(mgr) <= EDGES
        assert torch.equal(model(x), want)


def test_hooks_removed_inside_a_part_leave_nothing_read_ahead(ckpt, cap):
    path, x, want = ckpt
    model, mgr = started(path, cap)
    with mgr, torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.blocks[1].b.register_forward_hook(lambda *a: mgr.remove_forward_hooks())
        assert torch.equal(model(x), want)
        handle.remove()
        mgr.parts.pages.settle()
        assert not mgr.parts.pages.parts._ahead
        mgr.register_forward_hooks()
        assert torch.equal(model(x), want) and resident(mgr) <= EDGES


def test_close_inside_a_forward_leaves_nothing_in_flight(ckpt, cap):
    path, x, want = ckpt
    model, mgr = started(path, cap)
    with torch.no_grad():
        assert torch.equal(model(x), want)
        handle = model.blocks[1].a.register_forward_hook(lambda *a: mgr.close())
        out = model(x)  # the rest of the forward computes from the model given back
        handle.remove()
    assert torch.equal(out, want)
    assert not mgr.parts.pages.parts._ahead and not mgr.parts.pages.worker.running


def test_a_fork_with_a_part_read_ahead_in_flight(ckpt, tmp_path):
    """Forked inside a part (the next part's read queued on the parent's page worker): the child goes on
    with the forward, runs a whole one of its own and closes; the parent finishes its forward and runs
    more. Both compute the plain model's output and let every part go. (In a process of its own with
    one OpenMP thread: a child forked after OpenMP ran threads hangs in its first parallel op.)"""
    from child import describe, run_python

    path, x, want = ckpt
    torch.save({"x": x, "want": want}, tmp_path / "io.pt")
    proc = run_python(f"""
import os, torch
from mapoffload import LayerwiseOffloadManager
from mapoffload.pagecache import coordinator as coordinator_module
from fake_cgroups import v2_cap
import test_part_readahead as t
from room_stack import mapped
from child import reap
root = {str(tmp_path / "cg")!r}
coordinator_module.CGROUP_ROOT = root
v2_cap(root, t.half_a_layer(), t.IN_USE, 0, 0)
io = torch.load({str(tmp_path / "io.pt")!r})
x, want = io["x"], io["want"]
model = mapped({str(path)!r}, t.Model)
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
assert mgr.residency.depth == 1, mgr.residency.describe()
mgr.register_forward_hooks()
parent, pids = os.getpid(), []

def fork(module, args, output):
    if not pids:
        assert mgr.parts.pages.parts._ahead, "nothing read ahead at the fork"
        pids.append(os.fork())

with torch.no_grad():
    assert torch.equal(model(x), want)
    handle = model.blocks[2].b.register_forward_hook(fork)
    ok = False
    try:
        ok = torch.equal(model(x), want)
        if os.getpid() != parent:
            handle.remove()
            ok = ok and torch.equal(model(x), want) and t.resident(mgr) <= t.EDGES
            mgr.close()
            ok = ok and torch.equal(model(x), want)
    finally:
        if os.getpid() != parent:
            os._exit(0 if ok else 3)
    handle.remove()
    code = reap(pids[0], 60)
    for _ in range(2):
        assert torch.equal(model(x), want)
    assert t.resident(mgr) <= t.EDGES
mgr.close()
print("ok", ok, "child", code)
""", timeout=120, env={"OMP_NUM_THREADS": "1", "MAPOFFLOAD_PAGE_CACHE_MARGIN_MIB": str(MARGIN // MIB),
                       "MAPOFFLOAD_PEERS_DIR": str(tmp_path / "peers")})
    assert proc.returncode == 0 and "ok True child 0" in proc.stdout, describe(proc)


def test_parts_read_ahead_and_missing_give_the_thin_share_back():
    """The coordinator's check (``member.cached_lost``) counts what went missing of parts read ahead,
    where nothing is cached, as it does for cached layers (beyond its slack of 1 MiB + 1 %)."""
    from types import SimpleNamespace

    from mapoffload.pagecache.member import cached_lost

    sizes = [LAYER_BYTES] * BLOCKS
    ahead = plan_shared([sizes], PART_BYTES, prefetch_layers=[1], parts=[PART_BYTES], cache_only=PART_BYTES)[0]
    alone = plan_shared([sizes], PART_BYTES, prefetch_layers=[1], parts=[PART_BYTES])[0]
    assert not ahead.cached and ahead.depth == 1 and alone.depth == 0

    def member(plan, missing):
        return SimpleNamespace(given=None, residency=plan, take_missing=lambda: missing)

    assert cached_lost([member(ahead, 2 * MIB)]) == 2 * MIB
    assert cached_lost([member(ahead, MIB // 2)]) == 0  # the slack
    assert cached_lost([member(alone, 2 * MIB)]) == 0  # nothing read ahead, nothing cached: not the thin share's


def test_the_offload_entry_point_reads_parts_ahead_as_the_manager_does(ckpt, cap):
    """Every entry point starts its stacks through one front door (``start_stacks``): ``offload`` on a
    built model plans part by part with one read ahead, reads ahead while parts compute, and computes
    the plain model's output."""
    import mapoffload

    path, x, want = ckpt
    cap(half_a_layer())
    model = mapped_from(path, Model).eval()
    with mapoffload.offload(model, device="cpu", layers="blocks") as handle:
        (mgr,) = handle.managers.values()
        plan = mgr.residency
        assert plan.unit == PART and plan.depth == 1, plan.describe()
        ahead: list[bool] = []
        hooks = [getattr(model.blocks[i], p).register_forward_hook(
            lambda *a: ahead.append(bool(mgr.parts.pages.parts._ahead))) for i in range(BLOCKS) for p in ("a", "b", "c")]
        with torch.no_grad():
            assert torch.equal(model(x), want)  # the order learnt
            ahead.clear()
            assert torch.equal(model(x), want)
        for h in hooks:
            h.remove()
    assert ahead and all(ahead), ahead  # while each of these parts computed, the next one was read ahead


def test_freed_memory_goes_back_before_each_streamed_layer_only_below_a_layer(ckpt, cap, monkeypatch):
    """Where the room holds less than a layer, the allocator's freed blocks are the room: they go back
    (``malloc_trim``) before each streamed layer. Where a layer fits (part by part because two do not),
    they go back once a forward: a trim before each layer, and the faults it causes next, cost 0.11-0.18 s
    of kernel CPU a forward on the Llama of ``capped_forward.py`` for room the plan does not need."""
    from mapoffload.offload import runtime

    sizes = [LAYER_BYTES] * BLOCKS
    below = plan_shared([sizes], 2 * PART_BYTES, prefetch_layers=[1], parts=[PART_BYTES])[0]
    above = plan_shared([sizes], LAYER_BYTES + PART_BYTES, prefetch_layers=[1], parts=[PART_BYTES])[0]
    whole = plan_shared([sizes], 2 * LAYER_BYTES, prefetch_layers=[1], parts=[PART_BYTES])[0]
    assert (below.unit, above.unit, whole.unit) == (PART, PART, LAYER)
    assert runtime.below_a_layer(below) and not runtime.below_a_layer(above)
    assert not runtime.below_a_layer(whole) and not runtime.below_a_layer(None)

    path, x, want = ckpt
    trims: list[int] = []
    monkeypatch.setattr(runtime, "release_freed_memory", lambda: trims.append(1) or True)
    counts = []
    for room, below_it in ((half_a_layer(), True), (half_a_layer() + LAYER_BYTES, False)):
        cap(room)
        model = mapped_from(path, Model)
        with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
            assert mgr.residency.parts and runtime.below_a_layer(mgr.residency) == below_it, mgr.residency
            mgr.register_forward_hooks()
            with torch.no_grad():
                assert torch.equal(model(x), want)  # the plan's first forward, measured
                trims.clear()
                assert torch.equal(model(x), want)
            counts.append(len(trims))
    assert counts[0] - counts[1] == BLOCKS and counts[1] <= 1, counts  # once a forward at most, where measured


class SmallFirst(nn.Module):
    """Three 256 KiB projections, then one of 768 KiB (the largest part) that takes their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(W, W // 4, bias=False) for _ in range(3))
        self.big = nn.Linear(3 * (W // 4), W, bias=False)

    def forward(self, x):
        return x + self.big(torch.tanh(torch.cat([self.a(x), self.b(x), self.c(x)], -1)))


BIG = 3 * (W // 4) * W * 4  # SmallFirst's largest part


def small_first(tmp_file_dir, cap, room: int, **kw):
    """A stack of SmallFirst blocks under a cap that leaves the layers ``room`` bytes, its manager made."""
    torch.manual_seed(0)
    path, x, want = save_reference(Stack(BLOCKS, HEAD, block_cls=SmallFirst), torch.randn(3, W),
                                   tmp_file_dir / "small_first.safetensors")
    drop_page_cache(str(path))
    cap(IN_USE + MARGIN + W * HEAD * 4 + room)
    model = mapped_from(path, lambda: Stack(BLOCKS, HEAD, block_cls=SmallFirst))
    return model, LayerwiseOffloadManager(model, "blocks", device="cpu", **kw), x, want


def before_b_runs(model, mgr, x, want, look) -> tuple[list, list[int]]:
    """A second forward (the first learns the order) where, as each block's b is about to run,
    ``look(i, began)`` is recorded (``began``: a read's name -> an Event set when the page worker began
    it), with the page cache's bytes then and after each big part."""
    seen: list = []
    peaks: list[int] = []

    event = None  # the reads' watch, made inside the patch's context below

    def before_b(i):
        def hook(module, args):
            seen.append(look(i, event))
            peaks.append(resident(mgr))
        return hook

    with mgr, torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mgr.register_forward_hooks()
        event = ReadWatch(mp)
        assert torch.equal(model(x), want)  # the order learnt
        mgr.parts.pages.settle()
        event.clear()
        handles = [model.blocks[i].b.register_forward_pre_hook(before_b(i)) for i in range(BLOCKS)]
        handles += [model.blocks[i].big.register_forward_hook(lambda *a: peaks.append(resident(mgr)))
                    for i in range(BLOCKS)]
        assert torch.equal(model(x), want)
        for h in handles:
            h.remove()
    return seen, peaks


def test_behind_small_parts_the_window_holds_more_than_depth_parts(tmp_file_dir, cap):
    """The window is ``1 + depth`` of the largest part, in bytes: behind the small parts the largest one
    fits too, so its read begins while the first small part computes (with one part ahead counted as a
    part, it began only once the last small part was about to run). Never more than the window cached."""
    model, mgr, x, want = small_first(tmp_file_dir, cap, 2 * BIG + BIG // 4)  # two largest parts and a quarter
    plan = mgr.residency
    assert plan.unit == PART and plan.depth == 1 and plan.window_bytes == 2 * BIG, plan.describe()
    # a has computed, b is about to: the largest part's read has begun
    waited, peaks = before_b_runs(model, mgr, x, want, lambda i, event: event(f"layer {i} (blocks.{i}.big)").wait(5))
    assert len(waited) == BLOCKS and all(waited), waited
    assert max(peaks) <= 2 * BIG + EDGES, [p / MIB for p in peaks]


@pytest.mark.parametrize("prefetch", [1, 0])
def test_at_depth_0_the_smaller_parts_are_read_ahead_within_the_window(tmp_file_dir, cap, prefetch):
    """The room holds one of the largest part (depth 0): the three small parts fit the window together,
    so while a computes b and c are read (c's read has begun before b runs); the largest is not read
    ahead. With ``prefetch_layers=0`` nothing is."""
    model, mgr, x, want = small_first(tmp_file_dir, cap, BIG + BIG // 4, prefetch_layers=prefetch)
    plan = mgr.residency
    assert plan.unit == PART and plan.depth == 0 and plan.window_bytes == BIG, plan.describe()
    assert plan.readahead == bool(prefetch) and ("smaller parts read ahead" in plan.describe()) == bool(prefetch)

    def look(i, event):  # (c's read begun, big's read begun) as b is about to run
        c, big = event(f"layer {i} (blocks.{i}.c)"), event(f"layer {i} (blocks.{i}.big)")
        return c.wait(5 if prefetch else 0.2), big.is_set()

    seen, peaks = before_b_runs(model, mgr, x, want, look)
    assert seen == [(bool(prefetch), False)] * BLOCKS, seen
    assert max(peaks) <= BIG + EDGES, [p / MIB for p in peaks]
