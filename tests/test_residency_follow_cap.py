"""A measured residency plan follows the cgroup's memory cap: raised, the
next forward plans again (and caches what now fits); unchanged, no forward
plans again; a plan given in bytes is the caller's and stays. Fake cgroup
v2 trees (test_residency_plan's)."""

from __future__ import annotations

import pytest
import torch

from mapoffload import LayerwiseOffloadManager
from mapoffload.pagecache import coordinator as coordinator_module
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB

from stacks import LAYERS, mapped
from fake_cgroups import pin_whole_margin, v2_cap

MIB = 1 << 20


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.setattr(coordinator_module, "CGROUP_ROOT", str(tmp_path))

    def cap(mib: int) -> None:
        # 10 MiB in use besides the weights, no file cache.
        v2_cap(tmp_path, mib * MIB, 10 * MIB, 0, 0)
        pin_whole_margin(monkeypatch, mib * MIB)

    return cap


@pytest.fixture
def replans(monkeypatch) -> list[int]:
    """Count the plans the process's page-cache coordinator makes (after ``replans.clear()``)."""
    calls: list[int] = []
    coord = coordinator_module.coordinator()
    plan = coord._plan

    def counted(*args, **kwargs):
        calls.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(coord, "_plan", counted)
    return calls


def test_the_plan_follows_a_raised_cap_at_the_next_forward(ckpt, fake_cgroup, replans):
    path, x, want = ckpt
    fake_cgroup(85)  # about 8 MiB of page cache for 12 layers of 2 MiB: most stream
    model = mapped(path)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    assert mgr.residency.streamed, mgr.residency
    mgr.register_forward_hooks()
    calls = replans
    calls.clear()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    assert calls == []  # the cap did not change: no forward planned again
    fake_cgroup(200)  # raised: everything fits now
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    assert len(calls) == 1  # once, at the first forward after the change
    assert mgr.residency.streamed == () and mgr.residency.cached == tuple(range(LAYERS))
    fake_cgroup(85)  # lowered again
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert len(calls) == 2 and mgr.residency.streamed
    mgr.close()


def test_a_given_page_cache_budget_is_kept(ckpt, fake_cgroup, replans):
    path, x, want = ckpt
    fake_cgroup(85)
    model = mapped(path)
    layer = model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=6 * layer + 4096) as mgr:
        plan = mgr.residency
        mgr.register_forward_hooks()
        calls = replans
        calls.clear()
        fake_cgroup(200)
        with torch.no_grad():
            assert torch.equal(model(x), want)
        # (Other managers of this process may plan again; this one keeps its share.)
        assert mgr.residency is plan
