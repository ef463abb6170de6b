"""A measured residency plan follows the cgroup's memory cap: raised, the
next forward plans again (and caches what now fits); unchanged, no forward
plans again; a plan given in bytes is the caller's and stays. Fake cgroup
v2 trees (test_residency_plan's)."""

from __future__ import annotations

import importlib

import pytest
import torch

from mapoffload import LayerwiseOffloadManager
from mapoffload.budget import ENV_HOST_AVAILABLE_GIB

from test_offload_direct import LAYERS, ckpt, mapped  # noqa: F401 (ckpt is a fixture)
from test_residency_plan import _v2

MIB = 1 << 20
# The module (mapoffload.offload is also the name of the Hugging Face entry point).
offload_module = importlib.import_module("mapoffload.offload")


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    monkeypatch.setattr(offload_module, "CGROUP_ROOT", str(tmp_path))

    def cap(mib: int) -> None:
        # 10 MiB in use besides the weights, no file cache.
        _v2(tmp_path, mib * MIB, 10 * MIB, 0, 0)

    return cap


def counting_replans(mgr) -> list[int]:
    calls: list[int] = []
    replan = mgr.replan

    def counted(*args, **kwargs):
        calls.append(1)
        return replan(*args, **kwargs)

    mgr.replan = counted
    return calls


def test_the_plan_follows_a_raised_cap_at_the_next_forward(ckpt, fake_cgroup):
    path, x, want = ckpt
    fake_cgroup(85)  # about 8 MiB of page cache for 12 layers of 2 MiB: most stream
    model = mapped(path)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu")
    assert mgr.residency.streamed, mgr.residency
    mgr.register_forward_hooks()
    calls = counting_replans(mgr)
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


def test_a_given_page_cache_budget_is_kept(ckpt, fake_cgroup):
    path, x, want = ckpt
    fake_cgroup(85)
    model = mapped(path)
    layer = model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=6 * layer + 4096) as mgr:
        plan = mgr.residency
        mgr.register_forward_hooks()
        calls = counting_replans(mgr)
        fake_cgroup(200)
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert calls == [] and mgr.residency is plan
