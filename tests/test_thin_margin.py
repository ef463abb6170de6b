"""The cached set's thin margin: under a cgroup that counts the hits of its
cap, cached (reclaimable) weights may fill most of the budget's margin, the
streaming window never; once the count grows during a forward, the plan
keeps the whole margin until the cap changes. Fake cgroup trees."""

from __future__ import annotations

import logging

import pytest
import torch

from mapoffload import LayerwiseOffloadManager
from mapoffload._manager import coordinator as coordinator_module
from mapoffload._manager.residency import plan_shared
from mapoffload.budget import (
    ENV_HOST_AVAILABLE_GIB,
    ENV_PAGE_CACHE_MARGIN_MIB,
    cgroup_limit_hits,
    page_cache_budget,
)

from test_offload_direct import LAYERS, ckpt, mapped  # noqa: F401 (ckpt is a fixture)
from test_residency_plan import _v1, _v2, write

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


# --- the count and the budget -----------------------------------------------------------------


def test_hits_are_read_from_the_capped_cgroups_v2_events_and_v1_failcnt(tmp_path):
    _v2(tmp_path, 512 * MIB, 10 * MIB, 0, 0)
    assert cgroup_limit_hits(root=str(tmp_path)) is None  # no memory.events: not countable
    write(tmp_path, "sys/fs/cgroup/app/memory.events", "low 0\nhigh 2\nmax 5\noom 0\noom_kill 0\n")
    assert cgroup_limit_hits(root=str(tmp_path)) == 7
    write(tmp_path, "sys/fs/cgroup/app/memory.max", "max")
    write(tmp_path, "sys/fs/cgroup/app/memory.high", "max")
    assert cgroup_limit_hits(root=str(tmp_path)) is None  # uncapped: nothing to hit

    v1 = tmp_path / "v1"
    _v1(v1, 512 * MIB, 10 * MIB, 0, 0)
    write(v1, "sys/fs/cgroup/memory/app/memory.failcnt", "94\n")
    assert cgroup_limit_hits(root=str(v1)) == 94


def test_the_thin_margin_is_offered_only_where_hits_are_counted(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_PAGE_CACHE_MARGIN_MIB, raising=False)
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    cap = 1024 * MIB
    _v2(tmp_path, cap, 100 * MIB, 0, 0)
    assert page_cache_budget(0, root=str(tmp_path)).cache_extra == 0
    write(tmp_path, "sys/fs/cgroup/app/memory.events", "high 0\nmax 0\n")
    b = page_cache_budget(0, root=str(tmp_path))
    assert b.cache_margin == 8 * MIB + cap // 1024
    assert b.cache_extra == b.margin - b.cache_margin > 0
    assert "for the cached set" in str(b)
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, "32")  # the user's margin is the margin, for all
    assert page_cache_budget(0, root=str(tmp_path)).cache_extra == 0


# --- the coordinator --------------------------------------------------------------------------


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.delenv(ENV_PAGE_CACHE_MARGIN_MIB, raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))

    def cgroup(cap_mib: int, hits: int | None) -> None:
        _v2(tmp_path, cap_mib * MIB, 10 * MIB, 0, 0)  # 10 MiB in use besides the weights
        events = tmp_path / "sys/fs/cgroup/app/memory.events"
        if hits is None:
            events.unlink(missing_ok=True)
        else:
            write(tmp_path, "sys/fs/cgroup/app/memory.events", f"low 0\nhigh 0\nmax {hits}\n")

    return cgroup


def test_a_cap_hit_during_a_forward_gives_the_margin_back_until_the_cap_changes(ckpt, fake_cgroup, caplog):
    path, x, want = ckpt
    # 85 MiB: the whole margin (64 MiB + cap/32) leaves ~8 MiB for 12 layers of 2 MiB.
    fake_cgroup(85, None)
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        whole = mgr.residency
        assert len(whole.streamed) > LAYERS // 2, whole
    coord = coordinator_module.coordinator()
    assert coord.cache_extra == 0

    fake_cgroup(85, 3)  # the same cap, counted: the cached set takes the margin's thin share
    model = mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu") as mgr:
        assert coord.cache_extra > 0 and mgr.residency.streamed == (), mgr.residency
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        assert mgr.residency.streamed == ()  # no hit: the plan stands

        fake_cgroup(85, 4)  # the cap was hit during that forward
        with caplog.at_level(logging.INFO, logger="mapoffload"), torch.no_grad():
            assert torch.equal(model(x), want)
        assert coord.thin_margin_failed and coord.cache_extra == 0
        assert mgr.residency.streamed == whole.streamed, mgr.residency
        assert any("cached set keeps the whole margin" in r.getMessage() for r in caplog.records)

        plan = mgr.residency
        fake_cgroup(85, 9)  # more hits: nothing more to give back, no new plan
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert mgr.residency is plan

        fake_cgroup(86, 9)  # a new cap: the thin margin is tried again
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert not coord.thin_margin_failed and coord.cache_extra > 0 and mgr.residency.streamed == ()
