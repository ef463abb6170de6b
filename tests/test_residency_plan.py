"""The residency plan against fake budgets, and the page-cache budget on fake cgroup trees."""

from __future__ import annotations

import pytest

from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB, ENV_PAGE_CACHE_MARGIN_MIB, PageCacheBudget, page_cache_budget
from mapoffload.pagecache.residency import plan_residency

from fake_cgroups import DEFAULT_MARGIN_MIB, pin_whole_margin, v1_cap, v2_cap, write

MIB = 1 << 20


def test_everything_fits_everything_stays():
    plan = plan_residency([10, 10, 10], 30)
    assert plan.cached == (0, 1, 2) and plan.streamed == () and plan.streamed_bytes == 0


def test_two_streamed_layers_beside_the_cached_prefix_with_readahead():
    # 10 layers of 10: 60 of budget = 2 x 10 for the window, 4 layers cached.
    plan = plan_residency([10] * 10, 60)
    assert plan.readahead
    assert plan.cached == (0, 1, 2, 3) and plan.streamed == (4, 5, 6, 7, 8, 9)
    assert plan.cached_bytes == 40 and plan.streamed_bytes == 60
    assert plan.is_streamed(4) and not plan.is_streamed(3)


def test_tight_budget_streams_without_readahead():
    # Room for one layer and a half: reading ahead would evict the layer in use.
    plan = plan_residency([10] * 4, 15)
    assert not plan.readahead and plan.cached == () and plan.streamed == (0, 1, 2, 3)
    assert not plan_residency([10] * 4, 0).readahead
    # Room for two and a half: reading ahead (overlapped) wins over caching half a layer more.
    plan = plan_residency([10] * 4, 25)
    assert plan.readahead and plan.cached == ()
    # Room for one streamed layer of the largest size and a small one cached, no readahead.
    plan = plan_residency([10, 30, 10], 45)
    assert not plan.readahead and plan.cached == (0,) and plan.streamed == (1, 2)


def test_what_every_forward_reads_outside_the_layers_is_kept_out():
    assert plan_residency([10] * 10, 60, always_bytes=20).cached == (0, 1)
    assert plan_residency([10] * 10, 60, always_bytes=80).streamed == tuple(range(10))


def test_uneven_layers_reserve_the_largest_and_keep_a_prefix():
    plan = plan_residency([5, 5, 30, 5, 5, 30], 72)
    # window 2 x 30 = 60, 12 left: layers 0 and 1 (5 + 5) fit, layer 2 does not: the prefix stops.
    assert plan.readahead and plan.cached == (0, 1) and plan.streamed == (2, 3, 4, 5)
    assert "2 of 6 layers stay cached" in plan.describe()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="layer sizes must be >= 0"):
        plan_residency([10, -1], 100)


@pytest.mark.parametrize("tree", [v1_cap, v2_cap])
def test_budget_counts_other_files_cache_but_not_the_weights_own(tmp_path, tree):
    cap = 1024 * MIB
    # 300 MiB anonymous, 400 MiB of file cache of which 250 MiB are the weights' pages.
    tree(tmp_path, cap, 700 * MIB, 300 * MIB, 100 * MIB)
    b = page_cache_budget(250 * MIB, root=str(tmp_path))
    assert isinstance(b, PageCacheBudget) and b.source == "cgroup" and b.limit == cap
    assert b.other_bytes == 300 * MIB + 150 * MIB  # anon + the other files' 150 MiB
    assert b.margin == 96 * MIB  # 64 MiB + 1024 MiB / 32
    assert b.usable == 478 * MIB  # 1024 - 450 - 96
    # The same cgroup with the weights' pages gone from the cache: the same answer.
    tree(tmp_path, cap, 450 * MIB, 100 * MIB, 50 * MIB)
    assert page_cache_budget(0, root=str(tmp_path)).usable == b.usable


def test_budget_weights_charged_elsewhere_cost_nothing_here(tmp_path):
    # The weights' 500 MiB sit in the cache, charged to the cgroup that first read them.
    v1_cap(tmp_path, 1024 * MIB, 300 * MIB, 50 * MIB, 50 * MIB)
    b = page_cache_budget(500 * MIB, root=str(tmp_path))
    assert b.other_bytes == 200 * MIB  # anonymous only


def test_budget_memory_high_is_the_limit(tmp_path):
    v2_cap(tmp_path, 2048 * MIB, 100 * MIB, 0, 0, high=str(512 * MIB))
    assert page_cache_budget(0, root=str(tmp_path)).limit == 512 * MIB


def test_budget_override_and_uncapped(tmp_path, monkeypatch):
    write(tmp_path, "proc/self/cgroup", "0::/app\n")
    write(tmp_path, "proc/self/status", "RssAnon:\t  102400 kB\n")
    uncapped = page_cache_budget(0, root=str(tmp_path))
    assert uncapped.source == "machine" and uncapped.usable > 0
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "1")
    b = page_cache_budget(0, root=str(tmp_path))
    assert b.source == ENV_HOST_AVAILABLE_GIB and b.other_bytes == 100 * MIB
    assert b.limit == 1024 * MIB and b.margin == 96 * MIB  # 64 MiB + 1 GiB / 32
    assert b.usable == 828 * MIB  # 1024 - 100 (RssAnon) - 96
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "0.01")
    assert page_cache_budget(0, root=str(tmp_path)).usable == 0
    assert "usable" in str(b)


@pytest.mark.parametrize("tree", [v1_cap, v2_cap])
def test_margin_knob_replaces_the_default_margin(tmp_path, tree, monkeypatch):
    cap = 1024 * MIB
    tree(tmp_path, cap, 700 * MIB, 300 * MIB, 100 * MIB)
    default = page_cache_budget(250 * MIB, root=str(tmp_path))
    assert default.margin == 96 * MIB and default.usable == 478 * MIB  # 64 + 1024 / 32; 1024 - 450 - 96
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, "16")
    thin = page_cache_budget(250 * MIB, root=str(tmp_path))
    assert thin.margin == 16 * MIB and thin.usable == 558 * MIB  # 1024 - 450 - 16
    assert "margin 16.00 MiB" in str(thin)
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, "4096")  # long prefills: more room for activations
    assert page_cache_budget(250 * MIB, root=str(tmp_path)).usable == 0
    # The machine's budget and the host override take it too.
    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, "0")
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "1")
    assert page_cache_budget(0, root=str(tmp_path / "none")).margin == 0


@pytest.mark.parametrize("cap_mib", sorted(DEFAULT_MARGIN_MIB))
def test_default_margin_is_the_readmes_rule_worked_by_hand(tmp_path, monkeypatch, cap_mib):
    """The hand-worked table pin_whole_margin pins is the default margin itself, and pinning it
    changes nothing but the thin share."""
    monkeypatch.delenv(ENV_PAGE_CACHE_MARGIN_MIB, raising=False)
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)
    v2_cap(tmp_path, cap_mib * MIB, 10 * MIB, 0, 0)
    default = page_cache_budget(0, root=str(tmp_path))
    assert default.source == "cgroup" and default.margin == int(float(DEFAULT_MARGIN_MIB[cap_mib]) * MIB)
    pin_whole_margin(monkeypatch, cap_mib * MIB)
    pinned = page_cache_budget(0, root=str(tmp_path))
    assert (pinned.margin, pinned.usable) == (default.margin, default.usable) and pinned.cache_extra == 0


@pytest.mark.parametrize("bad", ["-1", "nan", "lots", "1048577"])
def test_margin_knob_refuses_with_the_variable_and_range(tmp_path, monkeypatch, bad):
    from mapoffload._env import EnvSettingError

    monkeypatch.setenv(ENV_PAGE_CACHE_MARGIN_MIB, bad)
    with pytest.raises(EnvSettingError, match=rf"{ENV_PAGE_CACHE_MARGIN_MIB}=.*a number of MiB from 0 to 1048576"):
        page_cache_budget(0, root=str(tmp_path))
