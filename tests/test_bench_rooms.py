"""benchmarks/_rooms.py: capped_forward --rooms sets each limit from the room a user has (issue 35)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from _rooms import cap_fraction, largest_layer_bytes, parse_rooms, room_in_layers, room_of  # noqa: E402


def test_rooms_parse_into_caps_and_back():
    assert parse_rooms("0.5, 1,4") == ["room0.5", "room1", "room4"]
    assert [room_of(c) for c in ("room0.5", "room4", "10", "none")] == [0.5, 4.0, None, None]
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="positive number of layers"):
            parse_rooms(bad)


def test_the_largest_layer_is_read_from_the_headers(tmp_path):
    save_file({"model.layers.0.w": torch.zeros(10), "model.layers.0.b": torch.zeros(2),
               "model.layers.1.w": torch.zeros(20), "model.embed_tokens.weight": torch.zeros(1000)},
              tmp_path / "a.safetensors")
    save_file({"model.layers.2.w": torch.zeros(5)}, tmp_path / "b.safetensors")
    assert largest_layer_bytes(str(tmp_path)) == 20 * 4  # the embedding is no layer
    (tmp_path / "a.safetensors").unlink()
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.layers"):
        largest_layer_bytes(str(tmp_path))


def test_the_limit_is_the_uncapped_peak_plus_the_room_and_the_room_is_measured_back():
    calibration = {"anon_peak": 400, "cgroup_baseline": 500}
    fraction = cap_fraction(calibration, 1.5, layer=100, checkpoint_bytes=1000)
    limit = calibration["cgroup_baseline"] + int(fraction * 1000)  # what the child writes
    assert limit == 550
    assert room_in_layers({"cgroup_cap": limit, "anon_peak": 400}, 100) == 1.5
    assert room_in_layers({"cgroup_cap": limit, "anon_peak": 450}, 100) == 1.0  # a peak above the uncapped one
    assert room_in_layers({"anon_peak": 400}, 100) is None  # uncapped
