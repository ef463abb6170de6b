"""One page-cache plan for every manager of the process (and its peers).

Fake cgroup v2 trees fix the budget; the plans are checked against it: two
stacks of one model share it (one streaming window, not two), a closed
manager leaves its share to the others, a given share is planned around, the
head read every forward is counted once and its resident pages are the
weights' own (not "other memory"). Peers are real child processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from mapoffload.offload.sequencer import Sequencer
from mapoffload import LayerwiseOffloadManager, drop_page_cache, empty_weights, load_checkpoint
from mapoffload.pagecache import coordinator as coordinator_module
from mapoffload.pagecache.residency import plan_residency, plan_shared
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB

from fake_cgroups import pin_whole_margin, v2_cap
from page_cache import taken_back_bytes
from stacks import save_reference

MIB = 1 << 20
WIDTH = 512  # 1 MiB a layer (fp32), plus its bias


class TwoStacks(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
        self.dec = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
        self.head = nn.Linear(WIDTH, WIDTH)  # read every forward, outside both stacks

    def forward(self, x):
        for b in self.enc:
            x = torch.tanh(b(x))
        for b in self.dec:
            x = torch.tanh(b(x))
        return self.head(x)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    ref = TwoStacks()
    return save_reference(ref, torch.randn(2, WIDTH), tmp_path_factory.mktemp("coord") / "two.safetensors")


def mapped(path) -> TwoStacks:
    with empty_weights():
        model = TwoStacks()
    load_checkpoint(model, path, keep_mapping=True)
    return model


@pytest.fixture
def cap(tmp_path, monkeypatch):
    # A coordinator of this test's own (conftest.fresh_page_cache_coordinator): these tests
    # measure the plan of their own managers only.
    assert not coordinator_module.coordinator().managers()
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", str(tmp_path / "peers"))  # no peers from other tests

    def set_cap(mib: int) -> None:
        v2_cap(tmp_path, mib * MIB, 10 * MIB, 0, 0)  # 10 MiB in use besides the weights, no file cache
        pin_whole_margin(monkeypatch, mib * MIB)

    return set_cap


def window(plan) -> int:
    return (1 + plan.depth) * max(plan.layer_bytes) if plan.streamed else 0


def test_plan_shared_keeps_one_window_and_fills_stacks_in_order():
    a, b = [10] * 6, [10] * 6
    plans = plan_shared([a, b], 60, prefetch_layers=[1, 1])
    assert [p.cached for p in plans] == [(0, 1, 2, 3), ()]  # 60 - one window of 2 layers
    assert sum(p.cached_bytes for p in plans) + max(map(window, plans)) <= 60
    # Two windows when two replicas stream from the same cached set at once.
    plans = plan_shared([a, b], 60, prefetch_layers=[1, 1], windows=2)
    assert sum(p.cached_bytes for p in plans) + 2 * max(map(window, plans)) <= 60
    # A stack that ends up wholly cached gives its window to the others.
    # (a window of 2 x 15 first; once the first stack is all cached, 2 x 10 for the second.)
    plans = plan_shared([[15], [10] * 8], 60, prefetch_layers=[1, 1])
    assert plans[0].streamed == () and plans[1].cached == (0, 1)
    # One member: the single-stack plan.
    assert plan_shared([a], 45, prefetch_layers=[2])[0] == plan_residency(a, 45, prefetch_layers=2)


def test_two_stacks_of_one_model_share_one_budget(ckpt, cap):
    path, x, want = ckpt
    cap(100)
    model = mapped(path)
    enc = LayerwiseOffloadManager(model, "enc", device="cpu")
    dec = LayerwiseOffloadManager(model, "dec", device="cpu")
    try:
        coord = coordinator_module.coordinator()
        room = coord.room
        assert enc.residency.budget == dec.residency.budget == room
        # One window beside everything cached, not one per stack.
        cached = enc.residency.cached_bytes + dec.residency.cached_bytes
        assert cached + max(window(enc.residency), window(dec.residency)) <= room
        # The head (outside both stacks, read every forward) counted once, out of
        # the room (other live models of this process count too: the budget is the process's).
        head = (WIDTH * WIDTH + WIDTH) * 4  # Linear(512, 512): weight and bias, fp32
        assert [m for m in coord.managers() if m.model is not model] == []  # the fixture saw no other
        assert coord.always_bytes == head
        # 100 MiB cap - 10 MiB in use - the 67.125 MiB margin (64 + 100/32) = 23986176 bytes, less the head.
        assert coord.budget.usable == 23986176
        assert room == 23986176 - head
        for m in (enc, dec):
            m.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        # Per-layer residency is measured, per stack.
        rows = dict(coord.layer_residency())
        assert len(rows["enc"]) == len(rows["dec"]) == 6
        assert f"{len(coord.managers())} stacks share" in coord.describe()
        # One closes: the other plans against everything it leaves.
        before = dec.residency.cached_bytes
        enc.close()
        assert dec.residency.cached_bytes >= before and dec.residency.budget == coord.room
    finally:
        enc.close()
        dec.close()
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_a_given_share_is_planned_around(ckpt, cap):
    path, _, _ = ckpt
    cap(100)
    model = mapped(path)
    given = 3 * MIB
    with LayerwiseOffloadManager(model, "enc", device="cpu", page_cache_bytes=given) as enc:
        with LayerwiseOffloadManager(model, "dec", device="cpu") as dec:
            coord = coordinator_module.coordinator()
            assert enc.residency.budget == given
            # 23986176 usable (test_two_stacks_...) less the given 3 MiB and the head; enc's layers,
            # outside dec, are no "read every forward" weights: they are planned in their share.
            head = (WIDTH * WIDTH + WIDTH) * 4
            assert coord.always_bytes == head
            assert coord.room == 23986176 - given - head
            assert dec.residency.budget == coord.room


def test_given_shares_only_show_no_measured_plan_left_from_before(ckpt, cap):
    """Once no measured stack is left, the coordinator shows the given shares, not the last measured plan:
    the head's bytes, the room and the budget of a closed manager's plan are gone (they were shown on, and
    ``streamed_since`` expected the head's bytes every forward)."""
    path, x, want = ckpt
    cap(100)
    model = mapped(path)
    coord = coordinator_module.coordinator()
    with LayerwiseOffloadManager(model, "dec", device="cpu"):
        assert coord.always_bytes > 0 and coord.budget is not None
    given = 3 * MIB
    with LayerwiseOffloadManager(model, "enc", device="cpu", page_cache_bytes=given) as enc:
        assert enc.residency.budget == given
        assert (coord.always_bytes, coord.always_streamed, coord.budget) == (0, False, None)
        assert coord.room == given and coord.window_buffers == coord.working_buffers == 0
        assert "share 3.00 MiB of page cache" in coord.describe(), coord.describe()
        assert "0 B read every forward outside the stacks" in coord.describe(), coord.describe()
        enc.register_forward_hooks()
        _, marks = coord.streamed_since(None)
        with torch.no_grad():
            assert torch.equal(model(x), want)
        expected, _ = coord.streamed_since(marks)
        assert expected == enc.residency.streamed_bytes  # the stack's own, no head counted


def test_a_warm_head_is_not_other_memory(ckpt, cap):
    path, x, _ = ckpt
    cap(100)
    model = mapped(path)
    with torch.no_grad():
        model(x)  # every page warm, the head's included
    with LayerwiseOffloadManager(model, "enc", device="cpu") as enc, \
            LayerwiseOffloadManager(model, "dec", device="cpu"):
        coord = coordinator_module.coordinator()
        head = coord.always_bytes
        layers = sum(sum(r) for _, r in coord.layer_residency())
        # The weights cached now include the head: it is not also in "other memory".
        assert coord.budget.weights_cached >= layers + head - 2 * 4096
        assert enc.parts.pages.resident_bytes() == coord.layer_residency()[0][1]


PEER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
    from mapoffload.pagecache.coordinator import coordinator

    path, go, out = sys.argv[1], sys.argv[2], sys.argv[3]
    import mapoffload.pagecache.coordinator as coordinator_module
    coordinator_module.CGROUP_ROOT = sys.argv[4]  # one cap for all: processes under none have no peers

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(8))
        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    with empty_weights():
        model = Stack()
    load_checkpoint(model, path, keep_mapping=True)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=1)
    mgr.register_forward_hooks()
    open(go + ".ready." + str(os.getpid()), "w").close()
    while not os.path.exists(go):
        time.sleep(0.02)
    with torch.no_grad():
        model(torch.ones(1, 512))  # the first forward follows the peers' records
    c = coordinator()
    json.dump({"pid": os.getpid(), "ranks": c.ranks, "replicas": c.replicas, "room": c.room,
               "usable": c.budget.usable, "cached": mgr.residency.cached_bytes,
               "window": (1 + mgr.residency.depth) * max(mgr.residency.layer_bytes)
                         if mgr.residency.streamed else 0}, open(out + ".tmp", "w"))
    os.replace(out + ".tmp", out)
    # Closing withdraws the record: not before every peer has planned with it.
    while not os.path.exists(go + ".close"):
        time.sleep(0.02)
    mgr.close()
    """
)


def _stack_file(path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    save_file({f"blocks.{i}.weight": torch.randn(512, 512, generator=g) for i in range(8)}, path)


def _run_peers(tmp_path, files: list) -> list[dict]:
    env = dict(os.environ, MAPOFFLOAD_PEERS_DIR=str(tmp_path / "peers"), **{ENV_HOST_AVAILABLE_GIB: "1.2"})
    go = str(tmp_path / "go")
    v2_cap(tmp_path / "cg", 2 << 30, 10 << 20, 0, 0)
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(f), go, str(tmp_path / f"out{k}.json"),
                               str(tmp_path / "cg")], env=env,
                              cwd=str(tmp_path),  # not the source folder: it would shadow the installed package
                              stderr=subprocess.PIPE, text=True) for k, f in enumerate(files)]
    try:
        import time

        deadline = time.monotonic() + 120
        while sum(n.startswith("go.ready.") for n in os.listdir(tmp_path)) < len(procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
        open(go, "w").close()
        deadline = time.monotonic() + 120
        outs = [tmp_path / f"out{k}.json" for k in range(len(procs))]
        while not all(o.exists() for o in outs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
        open(go + ".close", "w").close()
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [json.load(open(tmp_path / f"out{k}.json")) for k in range(len(procs))]


@pytest.mark.slow
def test_ranks_with_other_bytes_split_the_budget(tmp_path):
    a, b = tmp_path / "rank0.safetensors", tmp_path / "rank1.safetensors"
    _stack_file(a, 0)
    _stack_file(b, 1)
    outs = _run_peers(tmp_path, [a, b])
    pids = {o["pid"] for o in outs}
    for o in outs:
        assert o["ranks"] == list(pids - {o["pid"]}) and o["replicas"] == []
        # Its share: about half of everything, never the whole budget.
        assert o["room"] < 0.75 * o["usable"], o


@pytest.mark.slow
def test_replicas_of_the_same_bytes_share_the_cached_set(tmp_path):
    a = tmp_path / "same.safetensors"
    _stack_file(a, 0)
    outs = _run_peers(tmp_path, [a, a])
    pids = {o["pid"] for o in outs}
    for o in outs:
        assert o["replicas"] == list(pids - {o["pid"]}) and o["ranks"] == []
        assert o["room"] == o["usable"]  # not split: the cached pages are the same ones
        assert o["cached"] + 2 * o["window"] <= o["room"]  # a streaming window for each replica


def test_a_dead_peers_record_is_ignored_and_removed(tmp_path):
    from mapoffload.pagecache.peers import PeerRegistry

    reg = PeerRegistry(str(tmp_path / "peers"))
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    os.makedirs(reg.folder)
    with open(os.path.join(reg.folder, f"{dead}.json"), "w") as f:
        json.dump({"pid": dead, "start": "1", "ranges": [], "mapped": 1, "resident": 1, "window": 0}, f)
    with open(os.path.join(reg.folder, "garbage.json"), "w") as f:
        f.write("{not json")
    assert reg.peers() == []
    assert not os.path.exists(os.path.join(reg.folder, f"{dead}.json"))


def test_a_failed_start_leaves_nothing_behind(ckpt, cap, monkeypatch):
    path, x, want = ckpt
    cap(100)
    model = mapped(path)
    made = []
    real = Sequencer.engage

    def interrupted(self):  # the start's last step, after every part was made and the plan joined
        made.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Sequencer, "engage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LayerwiseOffloadManager(model, "enc", device="cpu")
    monkeypatch.setattr(Sequencer, "engage", real)
    (seq,) = made
    assert all(m.model is not model for m in coordinator_module.coordinator().managers())  # out of the shared plan
    assert seq.pages.files.held() == 0  # its files closed
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the model untouched
    with LayerwiseOffloadManager(model, "enc", device="cpu"):  # and can be offloaded again
        pass


def test_a_peers_resident_bytes_are_measured_here_not_taken_from_its_record(tmp_path):
    """A record's resident number is from when it was written; the plan measures the peer's files now."""
    from mapoffload.pagecache.peers import Peer, measure_resident

    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(4 << 20))
    os.sync()
    st = os.stat(path)
    peer = Peer(1, ((st.st_dev, st.st_ino, 4096, 3 << 20),), 3 << 20, resident_bytes=123, window_bytes=0,
                paths=((st.st_dev, st.st_ino, str(path)),))
    with open(path, "rb") as f:
        f.read()  # all cached, but for what reclaim takes back (page_cache.py)
        resident = measure_resident(peer)
        # Counted after: what was taken back before the measure is counted here too.
        taken = taken_back_bytes(f.fileno(), 4096, (3 << 20) - 4096)
    assert (3 << 20) - 4096 - taken <= resident <= (3 << 20) - 4096, (resident, taken)
    drop_page_cache(path)
    assert measure_resident(peer) == 0
    # A path that names another file now (or none) is not believed: the record's number is used.
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 8192)
    wrong = Peer(1, peer.ranges, peer.mapped_bytes, 123, 0, ((st.st_dev, st.st_ino, str(other)),))
    assert measure_resident(wrong) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert measure_resident(Peer(1, peer.ranges, 1, 1, 0, ((st.st_dev, st.st_ino, str(fifo)),))) is None


def test_uncached_buffers_are_not_counted_twice(ckpt, cap):
    """The O_DIRECT buffers hold the streaming window in anonymous memory: the measure counts them as
    other memory, the plan reserves the window itself - so they are added back, once."""
    path, x, want = ckpt
    cap(85)  # a few MiB of page cache for 6 layers of 1 MiB: most stream
    model = mapped(path)
    with LayerwiseOffloadManager(model, "enc", device="cpu", page_cache_bytes=None, reads="uncached") as enc:
        enc.register_forward_hooks()
        coord = coordinator_module.coordinator()
        if not enc.residency.streamed:
            pytest.skip("nothing streams under this budget")
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert enc.parts.loads.source.reader.held_bytes > 0
        enc.parts.replan()
        held = enc.parts.loads.source.reader.held_bytes
        assert held > 0 and coord.window_buffers == held
        assert coord.ranks == [] and coord.replicas == []  # no peers: nothing shared
        # 85 MiB cap - 10 MiB in use - the 66.65625 MiB margin (64 + 85/32) = 8749056 bytes usable;
        # less the dec stack and the head, read every forward outside enc (7 Linear(512, 512));
        # plus the uncached buffers, added back once (the plan reserves that window itself).
        dec_and_head = 7 * (WIDTH * WIDTH + WIDTH) * 4
        assert coord.budget.usable == 8749056 and coord.always_bytes == dec_and_head
        assert coord.room == 8749056 - dec_and_head + held > 0


@pytest.mark.parametrize("source,added", [("cgroup", "cache and buffers"), ("machine", "buffers"),
                                          ("MAPOFFLOAD_HOST_AVAILABLE_GIB", "nothing")])
def test_a_rank_s_memory_is_added_back_only_where_the_measure_took_it(monkeypatch, source, added):
    """Two ranks split the room by mapped bytes after adding back what the measure counted of the other as
    "other memory". Only a cgroup's measure counts its cache; the machine's available memory counts every
    file's cache as available, and the override's host counts only this process's anonymous memory. Added
    back on those, a rank's cache counted twice: two ranks on a host with no cap planned more than it had
    (found by a hostile review)."""
    from mapoffload.pagecache import peers as peers_module
    from mapoffload.pagecache.peers import Peer, share_room

    mib = 1 << 20
    rank = Peer(7, ((1, 2, 0, 32 * mib),), 32 * mib, resident_bytes=0, window_bytes=0, buffer_bytes=4 * mib)
    monkeypatch.setattr(peers_module, "resident_now", lambda p: 20 * mib)
    share = share_room([rank], lambda: ((1, 3, 0, 32 * mib),), 24 * mib, 32 * mib, source)
    assert share.ranks == [7] and not share.replicas
    back = {"cache and buffers": 24 * mib, "buffers": 4 * mib, "nothing": 0}[added]
    assert share.room == (24 * mib + back) // 2
