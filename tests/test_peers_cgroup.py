"""Peers are the processes that draw on one cap: the registry is keyed on the
cgroup the budget plans against (the tightest capped one on the path), not on
the leaf. Processes in sibling cgroups under one capped parent split its
budget; processes each under a cap of their own do not meet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import save_file

from mapoffload.memory.cgroup import tightest_cgroup
from mapoffload.pagecache.peers import PeerRegistry
from mapoffload.memory.budget import cgroup_memory_limit_bytes, page_cache_budget

from cgroups import memory_cgroup
from fake_cgroups import write

MIB = 1 << 20
GIB = 1 << 30


def _tree(root, leaf: str, caps: dict[str, int]) -> str:
    """A cgroup v2 tree under ``root`` with this process in ``leaf``; ``caps``: path -> memory.max."""
    write(root, "proc/self/cgroup", f"0::{leaf}\n")
    parts = [p for p in leaf.split("/") if p]
    for i in range(1, len(parts) + 1):
        rel = "/" + "/".join(parts[:i])
        d = f"sys/fs/cgroup{rel}"
        write(root, f"{d}/memory.max", str(caps[rel]) if rel in caps else "max")
        write(root, f"{d}/memory.current", str(100 * MIB))
        write(root, f"{d}/memory.stat", "anon 1\nactive_file 0\ninactive_file 0\n")
    return str(root)


def test_sibling_cgroups_under_one_capped_parent_share_one_folder(tmp_path):
    a = _tree(tmp_path / "a", "/pod/a", {"/pod": GIB})
    b = _tree(tmp_path / "b", "/pod/b", {"/pod": GIB})
    # The budget reads the parent's cap for both ...
    assert tightest_cgroup(root=a).path == tightest_cgroup(root=b).path == "/pod"
    assert cgroup_memory_limit_bytes(root=a) == cgroup_memory_limit_bytes(root=b) == (GIB, 100 * MIB)
    assert page_cache_budget(root=a).limit == GIB
    # ... so the two processes are peers: one record folder.
    assert PeerRegistry(root=a).folder == PeerRegistry(root=b).folder


def test_siblings_each_under_a_cap_of_their_own_do_not_meet(tmp_path):
    a = _tree(tmp_path / "a", "/pod/a", {"/pod/a": GIB})
    b = _tree(tmp_path / "b", "/pod/b", {"/pod/b": GIB})
    assert PeerRegistry(root=a).folder != PeerRegistry(root=b).folder
    # A leaf with a looser cap of its own draws on the parent's: the parent is the key.
    c = _tree(tmp_path / "c", "/pod/c", {"/pod": GIB, "/pod/c": 4 * GIB})
    d = _tree(tmp_path / "d", "/pod/d", {"/pod": GIB})
    assert PeerRegistry(root=c).folder == PeerRegistry(root=d).folder


PEER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
    from mapoffload.pagecache.coordinator import coordinator

    path, go, out = sys.argv[1], sys.argv[2], sys.argv[3]

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
    json.dump({"pid": os.getpid(), "ranks": c.ranks, "room": c.room, "usable": c.budget.usable,
               "source": c.budget.source}, open(out + ".tmp", "w"))
    os.replace(out + ".tmp", out)
    while not os.path.exists(go + ".close"):
        time.sleep(0.02)
    mgr.close()
    """
)


def _wait(cond, procs, what: str) -> None:
    deadline = time.monotonic() + 120
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, (what, [p.stderr.read()[-2000:] for p in dead])
        time.sleep(0.05)


@pytest.mark.slow
def test_processes_in_sibling_cgroups_under_one_real_cap_split_its_budget(tmp_path):
    try:
        cm = memory_cgroup(3 * GIB)
        parent = cm.__enter__()
    except OSError as exc:
        pytest.skip(str(exc))
    leaves = [os.path.join(parent, name) for name in ("a", "b")]
    procs: list[subprocess.Popen] = []
    try:
        for leaf in leaves:
            os.mkdir(leaf)  # no cap of its own: the parent's applies
        files = [tmp_path / f"rank{k}.safetensors" for k in range(2)]
        for k, f in enumerate(files):
            g = torch.Generator().manual_seed(k)
            save_file({f"blocks.{i}.weight": torch.randn(512, 512, generator=g) for i in range(8)}, f)
        env = {k: v for k, v in os.environ.items() if k != "MAPOFFLOAD_HOST_AVAILABLE_GIB"}
        env["MAPOFFLOAD_PEERS_DIR"] = str(tmp_path / "peers")
        go = str(tmp_path / "go")
        script = 'echo $$ > "$0/cgroup.procs" && exec "$1" -c "$2" "$3" "$4" "$5"'
        for k, (leaf, f) in enumerate(zip(leaves, files)):
            procs.append(subprocess.Popen(
                ["sh", "-c", script, leaf, sys.executable, PEER, str(f), go, str(tmp_path / f"out{k}.json")],
                env=env, cwd=str(tmp_path), stderr=subprocess.PIPE, text=True))
        _wait(lambda: sum(n.startswith("go.ready.") for n in os.listdir(tmp_path)) == 2, procs, "ready")
        open(go, "w").close()
        outs = [tmp_path / f"out{k}.json" for k in range(2)]
        _wait(lambda: all(o.exists() for o in outs), procs, "planned")
        open(go + ".close", "w").close()
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read()[-3000:]
        got = [json.loads(o.read_text()) for o in outs]
        pids = {o["pid"] for o in got}
        for o in got:
            assert o["source"] == "cgroup", o  # the parent's cap, seen from either leaf
            assert o["ranks"] == list(pids - {o["pid"]}), o  # the other leaf's process is a peer
            assert o["room"] < 0.75 * o["usable"], o  # half of one budget each, not the whole twice
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for leaf in leaves:
            for _ in range(50):
                try:
                    os.rmdir(leaf)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        cm.__exit__(None, None, None)


# -- no cap, no peers; the folder's name ----------------------------------------------------------

def test_processes_under_no_cap_are_peers_on_this_host_and_said_so(tmp_path, monkeypatch):
    """Issue 41: uncapped, the plan said "split with 1 other rank under this cap" where no cap applied.
    Uncapped processes of this user still draw on one machine (two ranks of one job would otherwise
    each plan the whole of it): they are peers, keyed apart from any cap, and the words say where."""
    from mapoffload.pagecache.coordinator import PageCacheCoordinator

    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", str(base))
    uncapped = PeerRegistry(root=_tree(tmp_path / "u", "/app", {}))
    capped = PeerRegistry(root=_tree(tmp_path / "c", "/app", {"/app": GIB}))
    assert uncapped.folder != capped.folder
    coord = PageCacheCoordinator()
    coord.ranks = [object()]
    assert "split with 1 other rank on this host (no cgroup cap)" in coord.describe()
    coord._cap = GIB
    assert "split with 1 other rank under this cap" in coord.describe()


def test_the_peers_folder_expands_the_home_and_says_when_it_cannot_be_made(tmp_path, monkeypatch, caplog):
    import logging

    capped = _tree(tmp_path / "c", "/app", {"/app": GIB})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", "~/peers")
    reg = PeerRegistry(root=capped)
    assert reg.folder.startswith(str(tmp_path / "home" / "peers") + os.sep)
    reg.publish([(1, 2, 0, 4096)], 4096, 0, 0)
    assert not os.path.lexists(tmp_path / "~") and os.listdir(reg.folder) == [f"{os.getpid()}.json"]
    reg.withdraw()
    # A folder that cannot be made (under a file): said at WARNING, once.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", str(tmp_path / "a-file" / "peers"))
    caplog.set_level(logging.DEBUG, logger="mapoffload")
    reg = PeerRegistry(root=capped)
    for _ in range(2):
        reg.publish([(1, 2, 0, 4096)], 4096, 0, 0)
    said = [r for r in caplog.records if "peers' folder" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said
    assert "a-file" in said[0].getMessage() and "MAPOFFLOAD_PEERS_DIR" in said[0].getMessage()
