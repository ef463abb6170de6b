"""The device path with streamed layers read uncached
(``reads="uncached"``, ``DeviceCopies`` with an ``UncachedSource``), run through its CPU twin:
outputs bit-identical to the mapping path, the reader's buffers reused and all
returned, the streamed layers kept out of the page cache, failures raised,
``close()`` with a read in flight clean. The CUDA side (pinned buffers, DMA,
buffer release ordered after the device copies) is in
test_device_uncached_cuda.py; a real-GPU run is at the end here."""

from __future__ import annotations

import os
import shutil
import sys
import threading

import pytest
import torch

from mapoffload import Copier, LayerwiseOffloadManager, MappingFaultError
from mapoffload.offload.loads import UncachedSource
from mapoffload.pagecache.uncached_read import UncachedReader

from stacks import LAYERS, assert_streamed_not_cached, mapped, warm_read_bytes


def _layer(model) -> int:
    return model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes


def _twin(model, *, depth: int = 1, cached: int = 3, reads: str = "uncached", **kw) -> LayerwiseOffloadManager:
    """A twin whose plan caches ``cached`` layers and streams the rest, ``depth`` read ahead."""
    room = (cached + 1 + depth) * _layer(model) + 4096
    return LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped",
                                   prefetch_layers=depth, page_cache_bytes=room, reads=reads, **kw)


def _forwards(model, x, n: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_outputs_equal_the_mapping_path_and_buffers_are_reused(ckpt, depth):
    path, x, want = ckpt
    outs = {}
    for mode in ("mapping", "uncached"):
        model = mapped(path)
        with _twin(model, depth=depth, reads=mode) as mgr:
            plan = mgr.residency
            assert plan.depth == depth and len(plan.cached) == 3 and len(plan.streamed) == LAYERS - 3
            assert mgr.parts.member.reads_mode == mode
            mgr.register_forward_hooks()
            outs[mode] = _forwards(model, x, 1)
            if mode == "uncached":
                loads = mgr.parts.loads
                assert isinstance(loads.source, UncachedSource)
                reader = loads.source.reader
                assert reader.buffers == 1 + depth
                allocations = reader.stats()["allocations"]
                held = reader.held_bytes
                assert 1 <= allocations <= 1 + depth and held == loads.window_bytes > 0
                direct0 = mgr.copier.stats().unstaged_bytes
            outs[mode] += _forwards(model, x, 3)
            if mode == "uncached":
                # Reused, not reallocated per forward; nothing leased between forwards.
                assert reader.stats()["allocations"] == allocations and reader.held_bytes == held
                assert reader.leased == 0 and loads.source.outstanding == 0
                # Every streamed layer was read uncached, once per forward, and copied
                # from its buffer without staging (the twin's unstaged copy: a plain memcpy).
                assert reader.stats()["reads"] == 4 * len(plan.streamed)
                assert mgr.copier.stats().unstaged_bytes - direct0 == 3 * plan.streamed_bytes
        if mode == "uncached":
            assert reader.leased == 0 and reader.held_bytes == 0  # all returned, and dropped by close()
    for a, b in zip(outs["mapping"], outs["uncached"]):
        assert torch.equal(a, want) and torch.equal(b, want)


def test_streamed_layers_stay_out_of_the_page_cache(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with _twin(model, depth=1, cached=3) as mgr:
        plan = mgr.residency
        mgr.register_forward_hooks()
        read = warm_read_bytes(model, x, want, path)
        assert_streamed_not_cached(mgr)
        stats = mgr.parts.loads.source.reader.stats()
        if stats["uncached_bytes"] == 0:
            pytest.skip("the checkpoint's folder takes no O_DIRECT here (tmpfs?)")
        # A warm forward reads the streamed layers once (whole aligned blocks: a page more at each end).
        assert plan.streamed_bytes <= read <= plan.streamed_bytes + len(plan.streamed) * 2 * 4096 + 65536, read
        # The file's cache holds the cached layers and the weights every forward reads (``mix``), and no more
        # than a 2 MiB folio at each end of them (fd_range_resident_bytes: mincore of the file).
        from mapoffload._native import _core

        file = mgr.parts.pages.extents(plan.cached[0])[0].file
        kept = sum(mgr.parts.layer_bytes(i) for i in plan.cached) + model.mix.weight.nbytes + model.mix.bias.nbytes
        assert _core.fd_range_resident_bytes(file.fd, 0, os.fstat(file.fd).st_size) <= kept + 2 * (2 << 20)


def test_mixed_stores_in_a_streamed_layer(tmp_path):
    """Mapped, consolidated and strided weights in one streamed layer: mapped ones from the buffer, the rest from
    their host stores, one copy job."""
    from models import TinyModel, mixed_model, no_grad_forward

    torch.manual_seed(0)
    reference = TinyModel(width=32, layers=4)
    want = no_grad_forward(reference)
    model = mixed_model(tmp_path, reference)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped",
                                 page_cache_bytes=0, reads="uncached") as mgr:
        assert {mgr.parts.store_of(n) for n in ("blocks.0.fc1.weight", "blocks.0.norm.weight", "blocks.1.fc2.weight")} \
            == {"mapped", "consolidated", "strided"}
        assert len(mgr.residency.streamed) == 4
        mgr.register_forward_hooks()
        for _ in range(3):
            assert torch.equal(no_grad_forward(model), want)
        assert mgr.parts.loads.source.reader.stats()["reads"] == 12


def test_auto_reads_uncached_where_the_files_take_o_direct(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with _twin(model, reads="auto") as mgr:
        assert mgr.parts.member.reads_mode == "mapping"  # decided at the first forward
        mgr.register_forward_hooks()
        assert all(torch.equal(y, want) for y in _forwards(model, x, 2))
        if not mgr.parts.member.probe_uncached()[0]:
            pytest.skip("the checkpoint's folder takes no O_DIRECT here (tmpfs?)")
        assert mgr.parts.member.reads_mode == "uncached", mgr.parts.member.reads_why
        assert "O_DIRECT" in mgr.parts.member.reads_why
    # Nothing streams: nothing to decide.
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped",
                                 page_cache_bytes=1 << 40) as mgr:
        mgr.register_forward_hooks()
        _forwards(model, x, 1)
        assert mgr.parts.member.reads_mode == "mapping"
    # "mapping" keeps the device path on the mapping.
    with _twin(model, reads="mapping") as mgr:
        mgr.register_forward_hooks()
        _forwards(model, x, 2)
        assert mgr.parts.member.reads_mode == "mapping" and not isinstance(mgr.parts.loads.source, UncachedSource)


@pytest.mark.parametrize("where", ["check", "read"])
def test_a_truncated_file_is_an_exception_and_the_buffers_come_back(ckpt, tmp_path, monkeypatch, where):
    """A streamed layer's bytes cut off: MappingFaultError from the file check before the layer runs, or (the check
    skipped) from the read on the reader's worker; no crash, every buffer back."""
    path, x, want = ckpt
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path, copy)
    model = mapped(copy)
    # The weights outside the layers (last in the file) owned: the cut reaches a streamed layer, not them.
    model.mix.weight = torch.nn.Parameter(model.mix.weight.detach().clone())
    model.mix.bias = torch.nn.Parameter(model.mix.bias.detach().clone())
    with _twin(model, cached=1) as mgr:
        mgr.register_forward_hooks()
        assert torch.equal(_forwards(model, x, 1)[0], want)
        last = max(mgr.residency.streamed, key=lambda i: mgr.parts.pages.extents(i)[0].end)
        assert last in mgr.residency.streamed
        with open(copy, "r+b") as f:
            f.truncate(mgr.parts.pages.extents(last)[0].end - _layer(model) // 2)
        if where == "read":
            monkeypatch.setattr(mgr.parts.pages, "check", lambda i: None)
        with torch.no_grad(), pytest.raises(MappingFaultError):
            model(x)
        reader = mgr.parts.loads.source.reader
        assert reader.leased == 0 and mgr.parts.loads.source.outstanding == 0
        assert not any(mgr.parts.is_loaded(i) for i in range(LAYERS))
    assert reader.held_bytes == 0


def test_a_failed_read_on_the_worker_is_raised_by_the_layer(ckpt, monkeypatch):
    """The read itself fails (not the up-front file check): raised at the layer, buffers and counters back."""
    path, x, want = ckpt
    model = mapped(path)
    with _twin(model) as mgr:
        mgr.register_forward_hooks()
        reader = mgr.parts.loads.source.reader
        real = UncachedReader._read_into

        def failing(self, *a, **kw):
            raise OSError(5, "injected read failure")

        monkeypatch.setattr(UncachedReader, "_read_into", failing)
        with torch.no_grad(), pytest.raises(OSError, match="injected"):
            model(x)
        assert reader.leased == 0 and mgr.parts.loads.source.outstanding == 0
        monkeypatch.setattr(UncachedReader, "_read_into", real)
        assert torch.equal(_forwards(model, x, 1)[0], want)  # the next forward reads afresh


def test_close_with_a_read_in_flight_is_clean(ckpt, monkeypatch):
    path, x, want = ckpt
    model = mapped(path)
    mgr = _twin(model, depth=2)
    mgr.register_forward_hooks()
    assert torch.equal(_forwards(model, x, 1)[0], want)
    reader = mgr.parts.loads.source.reader
    gate = threading.Event()
    real = UncachedReader._read_into

    def slow(self, *a, **kw):
        gate.wait(10)
        return real(self, *a, **kw)

    monkeypatch.setattr(UncachedReader, "_read_into", slow)
    streamed = mgr.residency.streamed
    mgr.prefetch_layer(streamed[0])
    mgr.prefetch_layer(streamed[1])  # both reads held on the worker
    assert mgr.parts.loads.source.outstanding == 2
    threading.Timer(0.2, gate.set).start()
    mgr.close()  # waits for the reads and the copies from them, gives every buffer back
    assert reader.leased == 0 and reader.held_bytes == 0
    assert torch.equal(_forwards(model, x, 1)[0], want)  # the model is whole again


def test_more_layers_than_buffers_fall_back_to_the_mapping(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with _twin(model, depth=1) as mgr:
        mgr.load_all_layers()  # every layer at once: two buffers, the other streamed layers through the mapping
        assert mgr.parts.loads.source.reader.leased <= 2
        assert torch.equal(_forwards(model, x, 1)[0], want)
        mgr.release_all()
        assert mgr.parts.loads.source.reader.leased == 0 and mgr.parts.loads.source.outstanding == 0


def test_switching_with_layers_loaded_through_the_mapping(ckpt, monkeypatch):
    """A switch (``auto``) meets layers the mapping path loaded: they are released as they were loaded.

    Released means given back to the device pool for the next layer, not freed: ``device_bytes`` (in
    use + pooled) is then every buffer the pool ever handed out - counted here by watching it hand them
    out - all of them back in the pool; only ``close()`` frees them (0)."""
    from mapoffload.offload.device_copies import DevicePool

    handed: dict[int, torch.Tensor] = {}  # id -> every distinct buffer take() returned
    real_take = DevicePool.take

    def take(self, nbytes):
        buf = real_take(self, nbytes)
        assert buf.numel() == nbytes
        handed[id(buf)] = buf
        return buf

    monkeypatch.setattr(DevicePool, "take", take)
    path, x, want = ckpt
    model = mapped(path)
    with _twin(model, reads="mapping", resident_layers=2) as mgr:
        mgr.register_forward_hooks()
        assert torch.equal(_forwards(model, x, 1)[0], want)
        assert mgr.parts.is_loaded(0) and mgr.parts.is_loaded(1)
        assert mgr.parts.device_bytes == sum(b.numel() for b in handed.values()) >= 2 * _layer(model)
        mgr.parts.member.read_uncached("a test")
        assert isinstance(mgr.parts.loads.source, UncachedSource) and mgr.parts.member.reads_why == "a test"
        assert all(torch.equal(y, want) for y in _forwards(model, x, 2))
        mgr.release_all()
        assert not any(mgr.parts.is_loaded(i) for i in range(LAYERS)) and mgr.parts.loads.source.reader.leased == 0
        made = sum(b.numel() for b in handed.values())
        pooled = mgr.parts.loads.pool.pooled()
        assert mgr.parts.device_bytes == made > 0  # released buffers stay pooled, none lost from the count
        assert {id(b) for b in pooled} == set(handed)  # every buffer back in the pool: none still in use
        assert all(torch.equal(y, want) for y in _forwards(model, x, 1))
        assert sum(b.numel() for b in handed.values()) == made  # the next forward reused them: none new
    assert mgr.parts.device_bytes == 0  # close() frees the pool


def test_autograd_is_refused_as_on_the_device_pipeline_and_no_grad_reads_uncached(ckpt):
    """Weights are device buffers either way: a layer under autograd keeps the uncached path, and recording a
    graph through the recycled device buffers is refused as on the mapping path."""
    path, x, want = ckpt
    model = mapped(path)
    for p in model.parameters():
        p.requires_grad_(False)
    with _twin(model) as mgr:
        mgr.register_forward_hooks()
        with pytest.raises(RuntimeError, match="device pipeline"):
            model(x.clone().requires_grad_(True))
        assert mgr.parts.loads.source.outstanding == 0
        assert torch.equal(model(x), want)  # grad mode on, nothing recorded: runs, read uncached
        assert mgr.parts.loads.source.reader.stats()["reads"] > 0


def test_forked_child_runs_with_the_parents_reads_in_flight(tmp_path):
    from child import describe, run_python

    proc = run_python(f"""
import os, threading, torch
from stacks import Stack, mapped, IN
from safetensors.torch import save_file
from mapoffload import LayerwiseOffloadManager
from mapoffload.pagecache.uncached_read import UncachedReader
torch.manual_seed(0)
ref = Stack()
path = {str(tmp_path / "stack.safetensors")!r}
save_file(ref.state_dict(), path)
x = torch.randn(3, IN)
with torch.no_grad():
    want = ref(x)
model = mapped(path)
layer = model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes
mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, host_store="mapped", prefetch_layers=2,
                              page_cache_bytes=6 * layer + 4096, reads="uncached")
mgr.register_forward_hooks()
with torch.no_grad():
    assert torch.equal(model(x), want)
gate = threading.Event()
real = UncachedReader._read_into
def slow(self, *a, **kw):
    gate.wait(5)
    return real(self, *a, **kw)
UncachedReader._read_into = slow
s = mgr.residency.streamed
mgr.prefetch_layer(s[0])
mgr.prefetch_layer(s[1])  # reads in flight on the parent's worker at the fork
pid = os.fork()
if pid == 0:
    code = 0
    try:
        gate.set()
        with torch.no_grad():
            for _ in range(2):
                if not torch.equal(model(x), want):
                    code = 3
        if mgr.parts.loads.source.outstanding != 0:
            code = 5
    except Exception as e:
        print("child:", type(e).__name__, e, flush=True)
        code = 4
    os._exit(code)
gate.set()
from child import reap
code = reap(pid, 60)
with torch.no_grad():
    assert torch.equal(model(x), want)
reader = mgr.parts.loads.source.reader
mgr.close()
assert reader.leased == 0
print("child", code)
""", timeout=120, env={"OMP_NUM_THREADS": "1"})  # torch's OpenMP pool hangs in a forked child otherwise
    assert proc.returncode == 0 and "child 0" in proc.stdout, describe(proc)


def test_an_explicit_copier_is_shared_and_left_open(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    copier = Copier("cpu", threads=2, staging_bytes=1 << 16, slots=2)
    with _twin(model, copier=copier) as mgr:
        mgr.register_forward_hooks()
        assert all(torch.equal(y, want) for y in _forwards(model, x, 2))
        assert mgr.parts.loads.copier is copier
    assert not copier.closed
    copier.close()


@pytest.mark.cuda
def test_cuda_uncached_reads_match_the_mapping_path(ckpt):
    path, x, want = ckpt
    outs = {}
    for mode in ("mapping", "uncached"):
        model = mapped(path)
        model.mix.cuda()  # the weights outside the blocks: on the device (the manager streams the blocks only)
        room = 6 * _layer(model) + 4096
        with LayerwiseOffloadManager(model, "blocks", device="cuda", host_store="mapped", prefetch_layers=2,
                                     page_cache_bytes=room, reads=mode) as mgr:
            assert mgr.residency.streamed and mgr.parts.member.reads_mode == mode
            mgr.register_forward_hooks()
            with torch.no_grad():
                outs[mode] = [model(x.cuda()).cpu() for _ in range(3)]
            if mode == "uncached":
                reader = mgr.parts.loads.source.reader
                assert reader.stats()["reads"] == 3 * len(mgr.residency.streamed)
                assert reader.pinned_bytes == reader.held_bytes > 0  # every buffer page-locked
                assert mgr.copier.stats().unstaged_bytes >= 3 * mgr.residency.streamed_bytes  # DMA, no staging
        if mode == "uncached":
            assert reader.leased == 0 and reader.held_bytes == 0 and reader.pinned_bytes == 0
    for a, b in zip(outs["mapping"], outs["uncached"]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want, rtol=1e-3, atol=1e-3)  # TF32 and other kernels than the CPU's


def test_ctrl_c_while_a_release_waits_for_its_copies_loses_no_buffer(ckpt, monkeypatch):
    # A KeyboardInterrupt in release()'s wait leaves that load holding its uncached
    # buffer (the copies may still read it); the layer stays loaded and the next turn
    # releases it. Were it lost, the count of loads holding a buffer would stay raised
    # and, once at the number of buffers, every streamed layer would quietly go back
    # to the mapping path.
    from mapoffload.offload import device_copies as dra

    path, x, want = ckpt
    model = mapped(path)
    with _twin(model, depth=1) as mgr:
        mgr.register_forward_hooks()
        loads = mgr.parts.loads
        real_wait = dra.ReadThenCopy.wait
        interrupts = {"left": 1}

        def wait(job):
            real_wait(job)  # the copies finish; the interrupt lands as release()'s wait returns
            if interrupts["left"] and sys._getframe(1).f_code.co_name == "release":
                interrupts["left"] -= 1
                raise KeyboardInterrupt

        monkeypatch.setattr(dra.ReadThenCopy, "wait", wait)
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            model(x)
        monkeypatch.setattr(dra.ReadThenCopy, "wait", real_wait)
        reads = loads.source.reader.stats()["reads"]
        for out in _forwards(model, x, 3):
            assert torch.equal(out, want)
        # Every streamed layer of the three forwards was still read uncached (one
        # more may be the interrupted forward's read-ahead, counted when its worker ran).
        assert loads.source.reader.stats()["reads"] - reads >= 3 * len(mgr.residency.streamed)
        assert loads.source.outstanding == 0 and loads.source.reader.leased == 0
