"""device="cpu": layers compute from their host stores (no copy), and the
residency plan reads per forward only the streamed layers' bytes."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from mapoffload import (
    LayerwiseOffloadManager,
    cow_report,
    drop_page_cache,
    rss_anon_bytes,
)

from stacks import IN, LAYERS, MIB, OUT, Stack, drain, io_read_bytes, layer_resident, mapped, warm_read_bytes  # noqa: F401,E501


def test_computes_from_the_mapping_without_a_copy(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    hosts = [p for b in model.blocks for p in b.parameters()]
    ptrs = [p.data_ptr() for p in hosts]
    with torch.no_grad():
        model(x)  # warm up torch's own allocations
    anon0 = rss_anon_bytes()
    with LayerwiseOffloadManager(model, "blocks", device="cpu", prefetch_layers=2) as mgr:
        assert mgr.copier is None and mgr.mapped_bytes == sum(p.nbytes for p in hosts)
        mgr.register_forward_hooks()
        seen = []
        hook = model.blocks[5].register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), want)
        hook.remove()
        assert seen == [ptrs[10]] * 3  # layer 5's weight computed from its own mapped bytes
        assert mgr.parts.device_bytes == 0 and mgr.peak_device_bytes == 0
        grown = rss_anon_bytes() - anon0
    assert grown < 2 * MIB, f"{grown} anonymous bytes for {mgr.mapped_bytes} of weights"  # not one layer's worth
    assert cow_report(hosts).anonymous_bytes == 0
    assert [p.data_ptr() for b in model.blocks for p in b.parameters()] == ptrs  # given back as they were
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_twin_and_in_place_agree(ckpt):
    path, x, want = ckpt
    outs = []
    for twin in (False, True):
        model = mapped(path)
        with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin) as mgr:
            mgr.register_forward_hooks()
            with torch.no_grad():
                outs.append(model(x))
            assert (mgr.copier is None) == (not twin)
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


def test_a_forward_reads_the_streamed_layers_once_and_keeps_the_cached_ones(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    layer = model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes
    # Room for 6 layers: 2 for the streaming window, 4 cached.
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=6 * layer + 4096,
                                  reads="mapping")  # the page-cache path
    plan = mgr.residency
    assert plan.readahead and plan.cached == (0, 1, 2, 3) and plan.streamed == tuple(range(4, LAYERS))
    mgr.register_forward_hooks()
    drop_page_cache(path)
    before = io_read_bytes()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    first = io_read_bytes() - before
    if first < LAYERS * layer // 2:
        pytest.skip(f"the checkpoint's folder reads nothing from a disk here ({first} bytes): tmpfs?")
    drain(mgr)
    reads = []
    for _ in range(3):
        before = io_read_bytes()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        drain(mgr)
        reads.append(io_read_bytes() - before)
        for i in plan.cached:
            assert layer_resident(mgr, i) >= layer - 8192, f"cached layer {i} was evicted"
        for i in plan.streamed:
            assert layer_resident(mgr, i) <= 64 * 1024, f"streamed layer {i} was not let go"
    streamed = plan.streamed_bytes
    for r in reads:
        assert 0.9 * streamed <= r <= 1.15 * streamed + MIB, (reads, streamed)
    mgr.close()


def _vm_flags(lo: int, hi: int) -> list[str]:
    """VmFlags of the mappings that overlap [lo, hi), from /proc/self/smaps."""
    flags, current = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and not line.startswith("VmFlags"):
                start, end = (int(v, 16) for v in first.split("-"))
                current = start < hi and lo < end
            elif line.startswith("VmFlags:") and current:
                flags.append(line)
    return flags


def test_managed_spans_get_no_readahead_until_closed(ckpt):
    path, x, _ = ckpt
    model = mapped(path)
    ptrs = [p.data_ptr() for p in model.blocks.parameters()]
    lo, hi = min(ptrs), max(ptrs) + 1
    assert not any(" rr" in f for f in _vm_flags(lo, hi))
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            model(x)
        assert any(" rr" in f for f in _vm_flags(lo, hi))  # MADV_RANDOM
    assert not any(" rr" in f for f in _vm_flags(lo, hi))


def test_update_and_sync_in_direct_mode(ckpt):
    path, x, want = ckpt
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        mgr.prefetch_layer(0, non_blocking=False)
        mgr.sync_layer_to_cpu(0)  # nothing to write back: the host store is what computes
        new = torch.zeros(OUT)
        mgr.update_cpu_weights({"blocks.0.bias": new})
        assert mgr.parts.store_of("blocks.0.bias") == "strided"
        assert torch.equal(model.blocks[0].bias, new)  # the loaded layer sees it
        with torch.no_grad():
            assert not torch.equal(model(x), want)
    assert torch.equal(model.blocks[0].bias, new)


def test_a_copier_is_refused_without_the_twin(ckpt):
    from mapoffload import Copier

    model = mapped(ckpt[0])
    with Copier("cpu") as copier:
        with pytest.raises(ValueError, match="cpu_twin"):
            LayerwiseOffloadManager(model, "blocks", device="cpu", copier=copier)
    # meta is no device the manager runs on: the one device rule says so before cpu_twin is looked at
    with pytest.raises(ValueError, match="device must be 'cuda', 'cuda:N' or 'cpu', not 'meta'"):
        LayerwiseOffloadManager(model, "blocks", device="meta", cpu_twin=True)
    assert importlib.import_module("mapoffload.offload").LayerwiseOffloadManager is LayerwiseOffloadManager
    assert os.path.exists(ckpt[0])
