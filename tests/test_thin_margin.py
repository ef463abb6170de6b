"""The cached set's thin margin: under a cgroup's cap, cached (reclaimable)
weights may fill most of the budget's margin, the streaming window never;
once the kernel took cached layers that a forward had read, the plan keeps
the whole margin until the cap changes. Fake cgroup trees; the kernel's
reclaim of a cached layer is done by hand (its pages unmapped and dropped)."""

from __future__ import annotations

import logging

import pytest
import torch

from mapoffload import LayerwiseOffloadManager, _core
from mapoffload.pagecache import coordinator as coordinator_module
from mapoffload.pagecache.residency import plan_shared
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB, ENV_PAGE_CACHE_MARGIN_MIB, page_cache_budget

from stacks import LAYERS, mapped
from fake_cgroups import v2_cap

MIB = 1 << 20


# --- the plan ---------------------------------------------------------------------------------


def test_cache_only_room_holds_cached_layers_never_the_window():
    sizes = [10] * 10
    base = plan_shared([sizes], 40, prefetch_layers=[1])[0]
    assert base.depth == 1 and len(base.cached) == 2  # 40 - a window of 2 layers
    more = plan_shared([sizes], 40, prefetch_layers=[1], cache_only=30)[0]
    assert more.depth == 1 and len(more.cached) == 5 and more.budget == 70
    # Depth is chosen within the budget alone: 15 bytes hold one streaming layer, not two.
    tight = plan_shared([sizes], 15, prefetch_layers=[1], cache_only=70)[0]
    assert tight.depth == 0 and len(tight.cached) == 7
    # Everything fits with the extra room: nothing streams.
    assert plan_shared([sizes], 40, cache_only=60)[0].streamed == ()
    with pytest.raises(ValueError, match="cache_only"):
        plan_shared([sizes], 40, cache_only=-1)


# --- the budget -------------------------------------------------------------------------------


def test_the_thin_margin_is_offered_under_a_cgroup_cap_unless_the_margin_is_the_users(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_PAGE_CACHE_MARGIN_MIB, raising=False)
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    cap = 1024 * MIB
    v2_cap(tmp_path, cap, 100 * MIB, 0, 0)
    b = page_cache_budget(0, root=str(tmp_path))
    # README: "64 MiB + 1/32 of the cgroup's limit, of which cached weights may use all but 8 MiB + 1/1024".
    assert b.source == "cgroup" and b.margin == 96 * MIB and b.cache_margin == 9 * MIB  # 64 + 32; 8 + 1
    assert b.cache_extra == 87 * MIB  # 96 - 9
    assert "for the cached set" in str(b)
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, "32")  # the user's margin is the margin, for all
    assert page_cache_budget(0, root=str(tmp_path)).cache_extra == 0
    monkeypatch.delenv(ENV_PAGE_CACHE_MARGIN_MIB)
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "1")  # not a cgroup's cap: nothing checks a thinner one
    assert page_cache_budget(0, root=str(tmp_path)).cache_extra == 0


# --- the coordinator --------------------------------------------------------------------------


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.delenv(ENV_PAGE_CACHE_MARGIN_MIB, raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))
    assert not coordinator_module.coordinator().thin_margin_failed  # a fresh one: no history (conftest)

    def cgroup(cap_mib: int) -> None:
        v2_cap(tmp_path, cap_mib * MIB, 10 * MIB, 0, 0)  # 10 MiB in use besides the weights

    return cgroup


def _reclaim(mgr, i: int) -> None:
    """What the kernel does to a cached layer under pressure: its pages out of RAM."""
    import os

    os.sync()  # a checkpoint written just now: dirty pages stay in the cache
    assert _core.unmap_file_pages(mgr.parts.pages.spans(i)) > 0  # out of this process's page tables
    for e in mgr.parts.pages.extents(i):  # and out of the page cache
        fd = os.open(e.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, e.first, e.end - e.first, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    assert sum(mgr.parts.pages.resident_bytes([i])) < mgr.parts.pages.mapped_sizes()[i] // 4


def test_cached_layers_taken_by_the_kernel_give_the_margin_back_until_the_cap_changes(ckpt, fake_cgroup, caplog):
    path, x, want = ckpt
    # 85 MiB with 10 in use: the whole margin (64 MiB + cap/32) would leave ~8 MiB for
    # 12 layers of 2 MiB; with the thin one (8 MiB + cap/1024) all of them fit.
    fake_cgroup(85)
    coord = coordinator_module.coordinator()
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        assert coord.cache_extra > 0 and mgr.residency.streamed == (), mgr.residency
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):  # the first reads the cached set; the later ones find it resident
                assert torch.equal(model(x), want)
        assert not coord.thin_margin_failed and mgr.residency.streamed == ()

        _reclaim(mgr, 3)  # the margin was too thin: the kernel took a cached layer
        with torch.no_grad():
            assert torch.equal(model(x), want)  # layer 3's use finds it gone (and reads it again)
        assert not coord.thin_margin_failed  # acted on at the next forward's start
        measures = []
        real = coord._plan_all
        coord._plan_all = lambda: (measures.append(1), real())[1]
        try:
            with caplog.at_level(logging.INFO, logger="mapoffload"), torch.no_grad():
                assert torch.equal(model(x), want)
        finally:
            del coord._plan_all
        # Placed again from the last measure (a new one would count what the forwards left in
        # the allocator as other memory, beside the margin that is there for it).
        assert measures == []
        assert coord.thin_margin_failed and coord.cache_extra == 0
        assert len(mgr.residency.streamed) > LAYERS // 2, mgr.residency  # the whole margin again
        assert any("kernel took" in r.getMessage() and "whole margin" in r.getMessage() for r in caplog.records)

        plan = mgr.residency
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        _reclaim(mgr, 0)  # nothing more to give back: no new plan
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert mgr.residency is plan

        fake_cgroup(86)  # a new cap: the thin margin is tried again
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert not coord.thin_margin_failed and coord.cache_extra > 0 and mgr.residency.streamed == ()


def test_a_cached_set_not_yet_read_is_not_a_loss(ckpt, fake_cgroup):
    path, x, want = ckpt
    fake_cgroup(85)
    coord = coordinator_module.coordinator()
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        for i in range(LAYERS):  # cold: nothing of the cached set in RAM before the first forward
            _reclaim(mgr, i)
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), want)
        assert not coord.thin_margin_failed and coord.cache_extra > 0


# --- what the check sees (review) -------------------------------------------------------------


@pytest.mark.parametrize("how", [{}, {"cpu_twin": True, "host_store": "mapped"}, {"reads": "uncached"}], ids=["in-place", "twin", "uncached"])
def test_a_cached_layer_taken_before_it_runs_is_seen(ckpt, fake_cgroup, how):
    """The kernel's LRU takes the cached layers used longest ago: mid-forward, those still to run
    (used in the last forward). They fault back in before the forward ends, so a check at the
    next forward's start finds them resident while every forward reads them again."""
    path, x, want = ckpt
    fake_cgroup(85)
    coord = coordinator_module.coordinator()
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", **how) as mgr:
        assert coord.cache_extra > 0 and mgr.residency.streamed == (), mgr.residency
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        hook = model.blocks[0].register_forward_pre_hook(lambda *_: _reclaim(mgr, 7))
        try:
            with torch.no_grad():
                for _ in range(3):  # each forward reads layer 7 again
                    assert torch.equal(model(x), want)
        finally:
            hook.remove()
        assert coord.thin_margin_failed and coord.cache_extra == 0
        assert mgr.residency.streamed, mgr.residency


class _EarlyExit(torch.nn.Module):
    """The test stack, run through its first ``depth`` blocks only (early exit; an encoder that a
    generate loop runs outside the model's forward is the same to the check)."""

    def __init__(self) -> None:
        super().__init__()
        from stacks import Stack
        self.inner = Stack()
        self.depth = LAYERS

    def forward(self, x):
        for b in self.inner.blocks[:self.depth]:
            x = torch.tanh(self.inner.mix(b(x)))
        return x


def test_a_cached_layer_no_forward_ran_is_not_a_loss(ckpt, fake_cgroup):
    from mapoffload import empty_weights, load_checkpoint

    path, x, _ = ckpt
    fake_cgroup(85)
    coord = coordinator_module.coordinator()
    with empty_weights():
        model = _EarlyExit()
    load_checkpoint(model.inner, path, keep_mapping=True)
    model.depth = 6
    with torch.no_grad():
        want = model(x)  # before the offload, from the same mapping
    with LayerwiseOffloadManager(model, "inner.blocks", device="cpu") as mgr:
        assert coord.cache_extra > 0 and mgr.residency.streamed == (), mgr.residency
        mgr.register_forward_hooks()
        for i in range(LAYERS):
            _reclaim(mgr, i)  # cold
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(model(x), want)
        assert not coord.thin_margin_failed and coord.cache_extra > 0


def test_a_cached_layer_whose_weights_were_updated_is_not_a_loss(ckpt, fake_cgroup):
    """update_cpu_weights gives a mapped weight an owned copy: its bytes leave the mapping, not RAM."""
    path, x, _ = ckpt
    fake_cgroup(85)
    coord = coordinator_module.coordinator()
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        assert coord.cache_extra > 0 and mgr.residency.streamed == (), mgr.residency
        mgr.register_forward_hooks()
        with torch.no_grad():
            want = model(x)
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                new = {n: f.get_tensor(n).clone() for n in f.keys() if n.startswith("blocks.3.")}
            mgr.update_cpu_weights(new)  # the same values, owned now
            for _ in range(3):
                assert torch.equal(model(x), want)
        assert not coord.thin_margin_failed and coord.cache_extra > 0


def test_the_next_model_tries_the_thin_share_again(ckpt, fake_cgroup):
    """Given back for one model's forwards; once every manager closed, a new model's are its own."""
    path, x, want = ckpt
    fake_cgroup(85)
    coord = coordinator_module.coordinator()
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        mgr.register_forward_hooks()
        with torch.no_grad():
            assert torch.equal(model(x), want)  # every cached layer used once
            _reclaim(mgr, 3)
            for _ in range(2):  # the second use finds it gone; the next forward gives the share back
                assert torch.equal(model(x), want)
        assert coord.thin_margin_failed and mgr.residency.streamed
    assert not coord.thin_margin_failed
    with LayerwiseOffloadManager(mapped(path), "blocks", device="cpu") as mgr:
        assert coord.cache_extra > 0 and mgr.residency.streamed == ()
