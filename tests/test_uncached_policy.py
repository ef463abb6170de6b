"""Streamed layers read uncached (``reads="uncached"``):
outputs equal, the streamed layers never enter the page cache, a warm
forward reads the streamed bytes once; ``"auto"`` switches after two warm
forwards that read more than the plan streams, and not otherwise."""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
import torch

from mapoffload import LayerwiseOffloadManager, MappingFaultError

from stacks import assert_streamed_not_cached, mapped, warm_read_bytes

# The reads policy's module (StackMember's: its /proc/self/io reader is replaced here).
member_module = importlib.import_module("mapoffload.pagecache.member")


def _layer(model) -> int:
    return model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes


def test_uncached_reads_compute_the_same_and_leave_the_page_cache_alone(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    layer = _layer(model)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=6 * layer + 4096,
                                 reads="uncached") as mgr:
        assert mgr.parts.member.reads_mode == "uncached"
        plan = mgr.residency
        assert plan.streamed and plan.cached
        mgr.register_forward_hooks()
        read = warm_read_bytes(model, x, want, path)
        assert_streamed_not_cached(mgr)
        # A warm forward reads the streamed layers once (whole aligned blocks: a page more at each end).
        assert plan.streamed_bytes <= read <= plan.streamed_bytes + len(plan.streamed) * 2 * 4096 + 65536, read
        assert mgr.parts.loads.source.reader.stats()["uncached_bytes"] > 0
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the model is whole again


def test_more_layers_than_buffers_fall_back_to_the_mapping(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=4 * _layer(model),
                                 reads="uncached") as mgr:
        mgr.load_all_layers()  # every layer at once: two buffers, the rest through the mapping
        with torch.no_grad():
            assert torch.equal(model(x), want)
        mgr.release_all()


def test_under_autograd_a_layer_reads_through_its_mapping_and_gradients_are_exact(ckpt):
    path, x, _ = ckpt
    from safetensors.torch import load_file

    from stacks import Stack
    ref = Stack()  # the checkpoint's weights, without the library: the exact gradients
    ref.load_state_dict(load_file(path))
    for p in ref.parameters():
        p.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    ref(xg).sum().backward()
    want = xg.grad
    grads = []
    for mode in ("mapping", "uncached"):
        model = mapped(path)
        for p in model.parameters():
            p.requires_grad_(False)  # frozen weights, input gradients (attribution)
        with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=4 * _layer(model),
                                     reads=mode) as mgr:
            mgr.register_forward_hooks()
            xg = x.clone().requires_grad_(True)
            model(xg).sum().backward()
            grads.append(xg.grad)
            if mode == "uncached":
                assert mgr.parts.loads.source.reader.stats()["reads"] == 0  # nothing went through a reused buffer
    assert torch.equal(grads[0], want) and torch.equal(grads[1], want)


def thrashing(monkeypatch) -> None:
    """Every forward of the process reads far more than its plans stream (``reads="auto"``'s measure):
    two warm forwards in a row switch an in-place stack to reading uncached (at its 4th)."""
    counter = itertools.count(0, 1 << 40)
    monkeypatch.setattr(member_module, "_process_read_bytes", lambda: next(counter))


@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_auto_reads_uncached_where_the_files_take_o_direct_on_the_device_path(ckpt, tmp_path, twin):
    """On the device path (the CPU twin here) ``auto`` reads streamed layers around the cache from the first
    streamed forward where their files take O_DIRECT; in place it reads through the mapping, which reads
    at the floor (issue 43), and measures."""
    import shutil

    path, x, want = ckpt
    places = {"disk": path}
    if os.path.isdir("/dev/shm"):
        shm = os.path.join("/dev/shm", f"mapoffload-test-{os.getpid()}.safetensors")
        shutil.copy(path, shm)
        places["tmpfs"] = shm
    extra = {"cpu_twin": True, "host_store": "mapped"} if twin else {}
    try:
        for where, p in places.items():
            model = mapped(p)
            with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=6 * _layer(model) + 4096,
                                         **extra) as mgr:
                assert mgr.parts.member.reads_mode == "mapping"  # decided at the first forward
                mgr.register_forward_hooks()
                with torch.no_grad():
                    for _ in range(3):
                        assert torch.equal(model(x), want)
                if where == "disk" and twin:
                    assert mgr.parts.member.reads_mode == "uncached", mgr.parts.member.reads_why
                    assert "O_DIRECT" in mgr.parts.member.reads_why
                elif where == "disk":  # measured: within the plan, so through the mapping
                    assert mgr.parts.member.reads_mode == "mapping" and "the plan streams" in mgr.parts.member.reads_why, mgr.parts.member.reads_why
                else:  # tmpfs pages are the file: nothing to read uncached (the weights are not even page cache)
                    assert mgr.parts.member.reads_mode == "mapping", mgr.parts.member.reads_why
            # Nothing streams: nothing to decide.
            with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=1 << 40) as mgr:
                mgr.register_forward_hooks()
                with torch.no_grad():
                    model(x)
                assert mgr.parts.member.reads_mode == "mapping"
    finally:
        if "tmpfs" in places:
            os.unlink(places["tmpfs"])


def test_a_truncated_file_is_an_exception(ckpt, tmp_path):
    import shutil

    path, x, _ = ckpt
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path, copy)
    model = mapped(copy)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=4 * _layer(model),
                                 reads="uncached") as mgr:
        mgr.register_forward_hooks()
        last = max(mgr.residency.streamed)
        size = copy.stat().st_size
        with open(copy, "r+b") as f:
            f.truncate(size - _layer(model) // 2)
        with torch.no_grad(), pytest.raises(MappingFaultError):
            model(x)
        assert last in mgr.residency.streamed


@pytest.mark.parametrize("reads, switched", [([10, 30, 30], True), ([10, 30, 10, 30], False), ([10, 11, 11], False)])
def test_auto_switches_after_two_warm_forwards_that_read_too_much(ckpt, monkeypatch, reads, switched):
    """reads: bytes each forward read, in units of what the plan streams (the first is the cold one)."""
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=6 * _layer(model) + 4096) as mgr:
        assert mgr.parts.member.reads_mode == "mapping"
        # As on a file system without O_DIRECT: the reads decide.
        monkeypatch.setattr(mgr.parts.member, "probe_uncached", lambda: (False, "tmpfs, say"))
        unit = mgr.residency.streamed_bytes / 10
        counter = iter([0] + [int(sum(reads[:k + 1]) * unit) for k in range(len(reads))])
        monkeypatch.setattr(member_module, "_process_read_bytes", lambda: next(counter))
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(len(reads) + 1):
                assert torch.equal(model(x), want)
        assert mgr.parts.member.reads_mode == ("uncached" if switched else "mapping"), mgr.parts.member.reads_why
        assert "the plan streams" in mgr.parts.member.reads_why


@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_auto_reads_through_the_shared_page_cache_while_replicas_map_the_same_bytes(ckpt, monkeypatch, tmp_path,
                                                                                     twin):
    # O_DIRECT reads are each process's own: two replicas streaming in step read 1.31x the
    # pair's bound reading uncached, 0.72x through the page cache they share (shared_cap.py).
    from mapoffload.pagecache import coordinator as coordinator_module
    from mapoffload.pagecache.peers import PeerLink

    coord = coordinator_module.coordinator()
    replicas: list[int] = []
    share = PeerLink.share

    def with_replicas(self, ranges_of, room, mine, source="cgroup"):
        found = share(self, ranges_of, room, mine, source)
        found.replicas = list(replicas)  # as if a peer record mapped these bytes
        return found

    monkeypatch.setattr(PeerLink, "share", with_replicas)
    # A measured budget (a given one plans without peers): a fake cgroup whose cap leaves
    # room for part of the stack.
    from fake_cgroups import pin_whole_margin, v2_cap

    monkeypatch.delenv("MAPOFFLOAD_HOST_AVAILABLE_GIB", raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setenv("MAPOFFLOAD_PEERS_DIR", str(tmp_path / "peers"))
    v2_cap(tmp_path, 100 << 20, 10 << 20, 0, 0)
    pin_whole_margin(monkeypatch, 100 << 20)
    path, x, want = ckpt
    model = mapped(path)
    extra = {"cpu_twin": True, "host_store": "mapped"} if twin else {}
    if not twin:
        thrashing(monkeypatch)  # in place auto reads uncached only where the mapping thrashes
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **extra) as mgr:
        assert mgr.residency.streamed and mgr.residency.cached, mgr.residency.describe()
        mgr.register_forward_hooks()

        def forward(note: str) -> None:
            with torch.no_grad():
                assert torch.equal(model(x), want), note

        for _ in range(1 if twin else 4):
            forward("alone")
        assert mgr.parts.member.reads_mode == "uncached", mgr.parts.member.reads_why
        reader = mgr.parts.loads.source.reader
        assert reader.held_bytes > 0
        replicas.append(4242)
        coord.replan()
        reads = reader.stats()["reads"]
        for _ in range(2):
            forward("with a replica")
        assert mgr.parts.member.reads_mode == "mapping" and "replicas (pid 4242)" in mgr.parts.member.reads_why
        assert reader.stats()["reads"] == reads  # nothing read uncached while paused
        assert reader.held_bytes == 0 and mgr.parts.loads.window_bytes == 0  # its buffers went
        replicas.clear()
        coord.replan()
        forward("alone again")
        assert mgr.parts.member.reads_mode == "uncached", mgr.parts.member.reads_why
        assert reader.stats()["reads"] > reads


def test_auto_judges_a_forward_by_what_every_model_read_since_it(ckpt, monkeypatch):
    """Two models in one process (a pipeline's components, two models served side by side): the
    process's read counter between two forwards of one holds the other's forwards too. Judged
    against one forward of each, five forwards of the other read "too much" and switched the first
    to uncached; against what each ran since, they read exactly the plans."""
    path, x, want = ckpt
    a, b = mapped(path), mapped(path)
    share = 6 * _layer(a) + 4096
    read = [0]
    monkeypatch.setattr(member_module, "_process_read_bytes", lambda: read[0])
    with LayerwiseOffloadManager(a, "blocks", device="cpu", page_cache_bytes=share) as ma, \
            LayerwiseOffloadManager(b, "blocks", device="cpu", page_cache_bytes=share) as mb:
        for model, mgr in ((a, ma), (b, mb)):
            monkeypatch.setattr(mgr.parts.member, "probe_uncached", lambda: (False, "tmpfs, say"))
            mgr.register_forward_hooks()
            streamed = mgr.residency.streamed_bytes
            assert streamed > 0
            # Each forward reads exactly what its plan streams (a page cache that behaves).
            model.register_forward_hook(lambda *_, n=streamed: read.__setitem__(0, read[0] + n))
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(a(x), want)
                for _ in range(5):
                    assert torch.equal(b(x), want)
        assert ma.parts.member.reads_mode == mb.parts.member.reads_mode == "mapping", (ma.parts.member.reads_why, mb.parts.member.reads_why)
        assert "the plan streams" in ma.parts.member.reads_why and "(1.00x)" in ma.parts.member.reads_why, ma.parts.member.reads_why
