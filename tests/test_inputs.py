"""Every input validated where it enters: environment variables and shard
plans refused with a typed error naming the variable or argument and the
accepted range in the user's units."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mapoffload import empty_weights, host_memory_available_bytes, load_checkpoint
from mapoffload._env import EnvSettingError
from mapoffload.memory.budget import ENV_HOST_AVAILABLE_GIB, page_cache_budget
from mapoffload.copier import Copier, resolve_settings

# --- environment variables ------------------------------------------------------------


@pytest.mark.parametrize("bad", ["1e300", "nan", "inf", "-1", "-0.5", "garbage", "1073741825"])
def test_host_gib_override_refuses_with_the_variable_and_range(monkeypatch, bad):
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, bad)
    for call in (host_memory_available_bytes, lambda: page_cache_budget(0)):
        with pytest.raises(EnvSettingError) as err:
            call()
        msg = str(err.value)
        assert f"{ENV_HOST_AVAILABLE_GIB}={bad!r}" in msg
        assert "a number of GiB from 0 to 1073741824" in msg
        assert isinstance(err.value, ValueError) and err.value.name == ENV_HOST_AVAILABLE_GIB


def test_host_gib_override_accepts_the_range_ends(monkeypatch):
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "0")
    assert host_memory_available_bytes() == 0
    monkeypatch.setenv(ENV_HOST_AVAILABLE_GIB, "1073741824")
    assert host_memory_available_bytes() > 1 << 59


@pytest.mark.parametrize("bad", ["0", "-1", "0.001", "4097", "1e9", "nan", "eight"])
def test_staging_mib_errors_speak_mib(monkeypatch, bad):
    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", bad)
    with pytest.raises(EnvSettingError) as err:
        resolve_settings()
    msg = str(err.value)
    assert f"MAPOFFLOAD_STAGING_MIB={bad!r}" in msg
    assert "a number of MiB from 0.00390625 to 4096" in msg
    assert "4294967296" not in msg  # no byte range for a MiB variable


def test_staging_mib_takes_fractions_of_a_mib(monkeypatch):
    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", "0.5")
    assert resolve_settings()[1] == 1 << 19


@pytest.mark.parametrize("var", ["MAPOFFLOAD_COPY_THREADS", "MAPOFFLOAD_STAGING_SLOTS"])
@pytest.mark.parametrize("bad", ["1.5", "0", "-2", "2.5e0", "lots"])
def test_whole_number_settings_refuse_fractions_and_zero(monkeypatch, var, bad):
    monkeypatch.setenv(var, bad)
    with pytest.raises(EnvSettingError, match=rf"{var}=.*expected a whole number from 1 to \d+"):
        resolve_settings()


def test_whole_number_settings_take_a_float_spelling_of_an_int(monkeypatch):
    monkeypatch.setenv("MAPOFFLOAD_COPY_THREADS", "2.0")
    assert resolve_settings()[0] == 2


def test_copier_arguments_are_typed(monkeypatch):
    for var in ("MAPOFFLOAD_COPY_THREADS", "MAPOFFLOAD_STAGING_MIB", "MAPOFFLOAD_STAGING_SLOTS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(TypeError, match=r"threads must be an int, not float \(1.5\)"):
        Copier("cpu", threads=1.5)
    with pytest.raises(TypeError, match="slots must be an int, not bool"):
        Copier("cpu", slots=True)
    with pytest.raises(ValueError, match=r"staging_bytes must be in 4096\.\.4294967296 bytes, got 100"):
        Copier("cpu", staging_bytes=100)


# --- shard plans ------------------------------------------------------------------------


class Tied(torch.nn.Module):
    def __init__(self, rows: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, rows, bias=False)
        self.b = torch.nn.Linear(4, rows, bias=False)
        self.b.weight = self.a.weight


@pytest.fixture
def tied_checkpoint(tmp_path):
    path = tmp_path / "tied.safetensors"
    save_file({"a.weight": torch.arange(32.0).reshape(8, 4)}, path)
    return path


def _load(path, **kw):
    with empty_weights():
        model = Tied(rows=4)
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 2)
    return model, lambda: load_checkpoint(model, path, keep_mapping=True, strict=False, **kw)


@pytest.mark.parametrize("dim", [1.0, "0", True, [0]])
def test_a_dimension_that_is_not_an_int_is_a_type_error_naming_the_key(tied_checkpoint, dim):
    model, load = _load(tied_checkpoint, shard_plan={"a.weight": dim})
    with pytest.raises(TypeError, match=r"shard_plan\['a.weight'\] = .*must be an int"):
        load()
    assert model.a.weight.device.type == "meta"  # nothing assigned
    _, load = _load(tied_checkpoint, shard_plan=lambda key: dim if key == "a.weight" else None)
    with pytest.raises(TypeError, match=r"shard_plan\('a.weight'\) = .*must be an int"):
        load()


@pytest.mark.parametrize("rank, world_size, what", [
    (0.5, 2, r"rank must be an int, not float \(0.5\)"),
    ("1", 2, r"rank must be an int, not str"),
    (0, 2.0, r"world_size must be an int, not float"),
    (False, 2, r"rank must be an int, not bool"),
])
def test_rank_and_world_size_must_be_ints(tied_checkpoint, rank, world_size, what):
    _, load = _load(tied_checkpoint, shard_plan={"a.weight": 0}, rank=rank, world_size=world_size)
    with pytest.raises(TypeError, match=what):
        load()


def test_rank_out_of_range_names_the_range(tied_checkpoint):
    _, load = _load(tied_checkpoint, shard_plan={"a.weight": 0}, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1 \(world_size 2\), got 2"):
        load()
    _, load = _load(tied_checkpoint, shard_plan={"a.weight": 0}, rank=0, world_size=0)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        load()


@pytest.mark.parametrize("rank, world_size", [(True, 2), (0, True), (0.5, 2), (0, 2.0)])
def test_shard_tensor_takes_no_bool_or_float_for_a_rank(rank, world_size):
    """A bool is an int to Python: ``rank=True`` took rank 1's slice, ``world_size=True`` the whole tensor."""
    from mapoffload import shard_tensor

    with pytest.raises(TypeError, match="must be an int"):
        shard_tensor(torch.arange(10.0), rank, world_size, 0)
    with pytest.raises(TypeError, match="dim must be an int"):
        shard_tensor(torch.arange(10.0), 0, 2, 0.0)


@pytest.mark.parametrize("rank, world_size", [(-1, 2), (2, 2), (True, 2), (1, None)])
def test_a_rank_without_a_plan_is_checked_all_the_same(tied_checkpoint, rank, world_size):
    model, load = _load(tied_checkpoint, rank=rank, world_size=world_size)
    with pytest.raises((TypeError, ValueError), match="rank"):
        load()
    assert model.a.weight.device.type == "meta"  # nothing assigned


def test_a_rank_without_a_plan_loads_every_tensor_whole(tied_checkpoint):
    with empty_weights():
        model = Tied(rows=8)
    load_checkpoint(model, tied_checkpoint, keep_mapping=True, strict=False, rank=1, world_size=2)
    assert torch.equal(model.a.weight, torch.arange(32.0).reshape(8, 4))  # a replica


@pytest.mark.parametrize("weight_bytes, available", [(float("nan"), 1 << 30), (1 << 20, float("nan")),
                                                      (True, 1 << 30), (1.5e9, 1 << 30)])
def test_the_copy_gate_takes_whole_byte_counts_only(weight_bytes, available):
    """NaN compared False everywhere: the gate answered "copies fit" for it (and for True)."""
    from mapoffload.memory.budget import host_copies_would_not_fit

    with pytest.raises(TypeError, match="must be a whole number of bytes"):
        host_copies_would_not_fit(weight_bytes, available_bytes=available, local_ranks=1)


def test_a_plan_of_the_wrong_kind_is_refused(tied_checkpoint):
    _, load = _load(tied_checkpoint, shard_plan=["a.weight"])
    with pytest.raises(TypeError, match="shard_plan must be a mapping"):
        load()


def test_conflicting_dims_in_a_tie_group_are_refused(tied_checkpoint):
    model, load = _load(tied_checkpoint, shard_plan={"a.weight": 0, "b.weight": 1})
    with pytest.raises(ValueError, match=r"tied weights a.weight, b.weight .*a.weight: 0, b.weight: 1"):
        load()
    assert model.a.weight.device.type == "meta"
    _, load = _load(tied_checkpoint, shard_plan={"a.weight": 0, "b.weight": None})
    with pytest.raises(ValueError, match="tied weights"):
        load()


def test_a_tie_group_split_once_loads_the_slice_for_both_names(tied_checkpoint):
    for plan in ({"a.weight": 0, "b.weight": 0}, {"b.weight": 0}):
        model, load = _load(tied_checkpoint, shard_plan=plan, rank=1)
        load()
        assert model.a.weight is model.b.weight
        assert torch.equal(model.a.weight, torch.arange(16.0, 32.0).reshape(4, 4))
