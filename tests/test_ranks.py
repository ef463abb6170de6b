"""Many ranks on one host, in one process: the local world, the gate, rank slices, rings."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

import mapoffload
from mapoffload import (
    GIB_BYTES,
    LayerwiseOffloadManager,
    MappedRegions,
    empty_weights,
    host_copies_would_not_fit,
    keep_checkpoint_mapped,
    load_checkpoint,
    local_world,
    shard_tensor,
)
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB
from mapoffload.memory.ranks import ENV_LOCAL_WORLD_SIZE, staging_ring_settings

from models import PLAN, Pair

GIB = GIB_BYTES
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _single_host(monkeypatch):
    monkeypatch.delenv(ENV_LOCAL_WORLD_SIZE, raising=False)
    monkeypatch.delenv(ENV_HOST_AVAILABLE_GIB, raising=False)


# --- the local world -----------------------------------------------------------------


def test_local_world_reads_torchrun_variable(monkeypatch):
    assert local_world().size == 1
    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, "4")
    world = local_world()
    assert (world.size, world.source) == (4, ENV_LOCAL_WORLD_SIZE)
    assert local_world(2).size == 2  # given wins


def test_local_world_size_is_read_like_every_other_variable(monkeypatch):
    # One parser for the package's environment (mapoffload._env): the same whole-number rule
    # ("2.0" is 2, as for MAPOFFLOAD_COPY_THREADS) and the same error, naming the range.
    from mapoffload._env import EnvSettingError

    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, "2.0")
    assert local_world().size == 2
    for bad in ("inf", "nan", "1e9", "0"):
        monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, bad)
        with pytest.raises(EnvSettingError, match="from 1 to 65536") as err:
            local_world()
        assert err.value.name == ENV_LOCAL_WORLD_SIZE


@pytest.mark.parametrize("bad", ["two", "0", "-1", "1.5"])
def test_local_world_refuses_garbage_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, bad)
    with pytest.raises(ValueError, match=ENV_LOCAL_WORLD_SIZE):
        local_world()
    with pytest.raises(ValueError, match="local_ranks"):
        local_world(0)


# --- the gate ------------------------------------------------------------------------------


def test_gate_counts_copies_once_per_local_rank_and_the_headroom_once(monkeypatch):
    # 10 GiB of weights on a host with 40 GiB available: one rank copies
    # (10 < 40 - 4); four ranks would need 40 GiB of copies plus four
    # reserves out of the same 40 GiB.
    assert not host_copies_would_not_fit(10 * GIB, available_bytes=40 * GIB)
    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, "4")
    assert host_copies_would_not_fit(10 * GIB, available_bytes=40 * GIB)
    # The boundary: n * w >= available - n * reserve.
    assert not host_copies_would_not_fit(6 * GIB - 1, available_bytes=40 * GIB)
    assert host_copies_would_not_fit(6 * GIB, available_bytes=40 * GIB)
    # The keyword overrides detection; 0 bytes always fit.
    assert not host_copies_would_not_fit(10 * GIB, available_bytes=40 * GIB, local_ranks=1)
    assert not host_copies_would_not_fit(0, available_bytes=0)


def test_gate_shares_a_cgroup_headroom_instead_of_counting_it_per_rank(tmp_path, monkeypatch):
    # Two ranks in one container capped at 32 GiB: the 32 GiB are split, not doubled.
    import psutil

    from mapoffload import host_memory_available_bytes

    cg = tmp_path / "sys/fs/cgroup/pod"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(str(32 * GIB))
    (cg / "memory.current").write_text("0")
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/pod\n")

    class VM:
        available = 512 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    available = host_memory_available_bytes(root=str(tmp_path))
    assert available == 32 * GIB
    assert not host_copies_would_not_fit(12 * GIB, available_bytes=available, local_ranks=1)
    assert not host_copies_would_not_fit(11 * GIB, available_bytes=available, local_ranks=2)
    assert host_copies_would_not_fit(12 * GIB, available_bytes=available, local_ranks=2)


def test_keep_checkpoint_mapped_logs_both_numbers(monkeypatch, caplog):
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "48")
    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, "4")
    with caplog.at_level(logging.INFO, logger="mapoffload"):
        assert keep_checkpoint_mapped(weight_bytes=10 * GIB, component="DiT")
    line = caplog.records[-1].getMessage()
    assert "4 local ranks (LOCAL_WORLD_SIZE)" in line
    assert "copies would take 40.00 GiB of anonymous memory" in line
    assert "a mapping 10.00 GiB of shared page cache" in line
    assert "keeping the checkpoint mapped" in line
    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, "1")
    assert not keep_checkpoint_mapped(weight_bytes=10 * GIB, component="DiT")


# --- slices ---------------------------------------------------------------------------------


def _checkpoint(tmp_path, tensors):
    path = tmp_path / "tp.safetensors"
    save_file(tensors, str(path))
    return path


def test_shard_tensor_rows_are_views_of_the_mapping_columns_are_copies(tmp_path):
    from safetensors import safe_open

    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    path = _checkpoint(tmp_path, {"w": w})
    with safe_open(str(path), framework="pt") as f:
        mapped = f.get_tensor("w")
    regions = MappedRegions()
    assert regions.holds(mapped)
    for rank in range(2):
        rows = shard_tensor(mapped, rank, 2, 0)
        assert rows.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr()
        assert rows.data_ptr() == mapped.data_ptr() + rank * 4 * 6 * 4
        assert regions.holds(rows) and rows.is_contiguous()
        torch.testing.assert_close(rows, w[rank * 4 : (rank + 1) * 4])
        cols = shard_tensor(mapped, rank, 2, 1)
        assert cols.is_contiguous() and not MappedRegions().holds(cols)
        torch.testing.assert_close(cols, w[:, rank * 3 : (rank + 1) * 3])
    assert shard_tensor(mapped, 1, 2, None) is mapped
    # A leading dimension of size 1 keeps a split along dim 1 contiguous.
    assert shard_tensor(mapped.view(1, 8, 6), 1, 2, 1).data_ptr() == mapped.data_ptr() + 4 * 6 * 4


@pytest.mark.parametrize(
    "args, match",
    [((0, 3, 0), "does not split evenly"), ((2, 2, 0), "rank 2 is outside"), ((0, 2, 2), "out of range"),
     ((0, 0, 0), "world_size must be")],
)
def test_shard_tensor_refuses_what_it_cannot_split(args, match):
    with pytest.raises(ValueError, match=match):
        shard_tensor(torch.zeros(4, 6), *args)


def test_load_checkpoint_with_a_shard_plan_maps_rows_and_counts_copied_columns(tmp_path):
    torch.manual_seed(0)
    full = Pair(16, 32)
    path = _checkpoint(tmp_path, {k: v.contiguous() for k, v in full.state_dict().items()})
    x = torch.randn(3, 16)
    partial = []
    for rank in range(2):
        with empty_weights():
            model = Pair(16, 32, tp=2)
        report = load_checkpoint(model, path, keep_mapping=True, shard_plan=PLAN, rank=rank, world_size=2)
        regions = MappedRegions()
        assert regions.holds(model.up.weight) and regions.holds(model.up.bias)
        assert not regions.holds(model.down.weight)
        up_bytes = (16 * 16 + 16) * 4
        down_bytes = 16 * 16 * 4
        assert report.shard == (rank, 2)
        assert report.bytes_sliced_mapped == up_bytes == report.bytes_mapped
        assert report.bytes_sliced_copied == down_bytes == report.bytes_copied
        assert report.copied == {"column slice": down_bytes}
        assert "Rank %d of 2" % rank in str(report)
        with torch.no_grad():
            partial.append(model(x))
    with torch.no_grad():
        torch.testing.assert_close(partial[0] + partial[1], full(x), rtol=1e-5, atol=1e-5)


def test_shard_plan_as_a_callable_and_the_copy_path(tmp_path):
    torch.manual_seed(1)
    full = Pair(8, 16)
    path = _checkpoint(tmp_path, {k: v.contiguous() for k, v in full.state_dict().items()})
    with empty_weights():
        model = Pair(8, 16, tp=2)
    report = load_checkpoint(
        model, path, keep_mapping=False, shard_plan=lambda k: PLAN.get(k), rank=1, world_size=2
    )
    # Copies asked for: rows are cloned for that reason, columns for theirs.
    assert report.bytes_mapped == 0 and report.bytes_sliced_mapped == 0
    assert report.copied == {"keep_mapping=False": (8 * 8 + 8) * 4, "column slice": 8 * 8 * 4}
    torch.testing.assert_close(model.up.weight, full.up.weight[8:])
    torch.testing.assert_close(model.down.weight, full.down.weight[:, 8:])


def test_shard_plan_errors_name_the_key(tmp_path):
    full = Pair(8, 16)
    path = _checkpoint(tmp_path, {k: v.contiguous() for k, v in full.state_dict().items()})
    with empty_weights():
        model = Pair(8, 16, tp=2)
    with pytest.raises(ValueError, match="up.wieght"):
        load_checkpoint(model, path, keep_mapping=True, shard_plan={"up.wieght": 0}, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"up.weight: rank 0's slice \(16, 4\) of checkpoint shape \(16, 8\)"):
        load_checkpoint(model, path, keep_mapping=True, shard_plan={"up.weight": 1}, rank=0, world_size=2)
    with pytest.raises(ValueError, match="up.weight dimension 0: size 16 does not split evenly"):
        load_checkpoint(model, path, keep_mapping=True, shard_plan={"up.weight": 0}, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank and world_size"):
        load_checkpoint(model, path, keep_mapping=True, shard_plan=PLAN)
    assert model.up.weight.device.type == "meta"  # nothing assigned


def test_gate_weighs_this_ranks_slices_not_the_checkpoint(tmp_path, monkeypatch, caplog):
    full = Pair(8, 16)
    path = _checkpoint(tmp_path, {k: v.contiguous() for k, v in full.state_dict().items()})
    monkeypatch.setenv(ENV_LOCAL_WORLD_SIZE, "2")
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "1000")
    with empty_weights():
        model = Pair(8, 16, tp=2)
    with caplog.at_level(logging.INFO, logger="mapoffload"):
        report = load_checkpoint(model, path, shard_plan=PLAN, rank=0, world_size=2)
    assert not report.keep_mapping
    gate = next(r.getMessage() for r in caplog.records if "local ranks" in r.getMessage())
    slice_gib = ((8 * 8 + 8) + 8 * 8) * 4 / GIB
    assert f"Pair (rank 0 of 2): {slice_gib:.2f} GiB" in gate
    assert "2 local ranks (LOCAL_WORLD_SIZE)" in gate


# --- the offload manager per rank -------------------------------------------------------


def test_staging_rings_divided_by_local_ranks_when_tight():
    assert staging_ring_settings(threads=4, slot_bytes=8 * MIB, slots=8, local_ranks=8,
                                 available_bytes=64 * GIB) == (4, 8 * MIB, 8)
    # 8 rings of 64 MiB in 1 GiB available: more than 1/8 of it. Slots / 8 -> 2
    # (1 MiB * ... still 8 * 16 MiB = 128 MiB fits in 128 MiB), threads <= slots.
    assert staging_ring_settings(threads=4, slot_bytes=8 * MIB, slots=8, local_ranks=8,
                                 available_bytes=1 * GIB) == (2, 8 * MIB, 2)
    # Tighter: the slot size is divided too, down to 1 MiB.
    assert staging_ring_settings(threads=4, slot_bytes=8 * MIB, slots=8, local_ranks=8,
                                 available_bytes=256 * MIB) == (2, 1 * MIB, 2)
    assert staging_ring_settings(threads=4, slot_bytes=8 * MIB, slots=8, local_ranks=1,
                                 available_bytes=0) == (4, 8 * MIB, 8)


def test_a_shrunk_ring_never_gets_larger_slots():
    # Slots the user made smaller than the shrink's 1 MiB floor stay as they are (they grew to 1 MiB:
    # "shrinking" a 64 KiB x 64 ring for 8 ranks in 1 MiB gave 8 slots of 1 MiB each).
    from mapoffload.copier import MIN_SLOT_BYTES
    from mapoffload.memory.ranks import SHRUNK_SLOT_FLOOR_BYTES

    assert MIN_SLOT_BYTES == 4096 < SHRUNK_SLOT_FLOOR_BYTES == MIB  # two bounds, two names
    threads, slot_bytes, slots = staging_ring_settings(threads=4, slot_bytes=64 << 10, slots=64, local_ranks=8,
                                                       available_bytes=1 * MIB)
    assert slot_bytes == 64 << 10 and slots == 8 and threads == 4


class Stack(torch.nn.Module):
    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Pair(16, 64, tp) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_manager_streams_only_this_ranks_slice_with_a_ring_that_fits(tmp_path, monkeypatch):
    monkeypatch.setenv("MAPOFFLOAD_STAGING_SLOTS", "8")
    monkeypatch.setenv("MAPOFFLOAD_COPY_THREADS", "2")
    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", "8")
    full = Stack()
    path = _checkpoint(tmp_path, {k: v.contiguous() for k, v in full.state_dict().items()})
    plan = {f"blocks.{i}.{k}": d for i in range(3) for k, d in PLAN.items()}
    with empty_weights():
        model = Stack(tp=2)
    load_checkpoint(model, path, keep_mapping=True, shard_plan=plan, rank=1, world_size=2)
    whole_layer = sum(p.nbytes for p in full.blocks[0].parameters())
    with LayerwiseOffloadManager(model, "blocks", device="cpu", host_store="mapped", local_ranks=4,
                                 available_bytes=512 * MIB, cpu_twin=True) as manager:
        assert manager.options.local_ranks == 4
        assert manager.parts.layer_bytes(0) * 2 == whole_layer  # each rank streams its half
        # 4 rings of 8 x 8 MiB > 512 MiB / 8: slots divided by the local ranks.
        assert (manager.copier.slots, manager.copier.staging_bytes, manager.copier.threads) == (2, 8 * MIB, 2)
        assert manager.mapped_bytes == sum(p.nbytes for n, p in model.named_parameters() if "up." in n)
        manager.register_forward_hooks()
        x = torch.randn(2, 16)
        with torch.no_grad():
            y = model(x)
    assert y.shape == (2, 16)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", local_ranks=4,
                                 available_bytes=64 * GIB, cpu_twin=True) as roomy:
        assert (roomy.copier.slots, roomy.copier.staging_bytes) == (8, 8 * MIB)


def test_public_names():
    assert {"shard_tensor", "local_world", "LocalWorld"} <= set(mapoffload.__all__)
