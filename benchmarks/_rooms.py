"""capped_forward.py --rooms: limits set by the room a user has, in layers (issue 35).

A user's container has a memory limit; what the model may fill is that limit less what the process
holds at its peak (the libraries, the first use of torch, the load's buffers: anonymous memory).
So a row's limit is the contender's own uncapped peak of anonymous memory plus ``room`` times the
largest decoder layer, and the table says the room it really had at its peak ("room in layers":
the limit less this run's peak anonymous memory, over the largest layer).
"""

from __future__ import annotations

import json
import os
import re
import struct

__all__ = ["cap_fraction", "figure", "largest_layer_bytes", "parse_rooms", "room_in_layers"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def parse_rooms(text: str) -> list[str]:
    """``"0.5,1,2"`` -> the caps ``["room0.5", "room1", "room2"]`` (each a positive number of layers)."""
    rooms = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        value = float(part)
        if not value > 0:
            raise ValueError(f"a room is a positive number of layers, not {part!r}")
        rooms.append(f"room{part}")
    return rooms


def room_of(cap: str) -> float | None:
    """The room in layers a cap names (``"room1.5"`` -> 1.5), None for a percentage cap."""
    return float(cap[len("room"):]) if cap.startswith("room") else None


def largest_layer_bytes(folder: str) -> int:
    """Bytes of the largest decoder layer (``model.layers.N.*``), read from the safetensors headers."""
    per: dict[int, int] = {}
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, info in header.items():
            m = _LAYER.match(key)
            if m and isinstance(info, dict):
                start, end = info["data_offsets"]
                per[int(m.group(1))] = per.get(int(m.group(1)), 0) + end - start
    if not per:
        raise ValueError(f"{folder}: no model.layers.N tensors")
    return max(per.values())


def cap_fraction(calibration: dict, room: float, layer: int, checkpoint_bytes: int) -> float:
    """The child's ``--fraction`` (of the checkpoint, above its cgroup baseline) that sets the limit to
    the uncapped run's peak anonymous memory plus ``room`` layers."""
    limit = calibration["anon_peak"] + room * layer
    return (limit - calibration["cgroup_baseline"]) / checkpoint_bytes


def room_in_layers(r: dict, layer: int) -> float | None:
    """The room a run had at its peak: its limit less its peak anonymous memory, in layers."""
    if "cgroup_cap" not in r or "anon_peak" not in r:
        return None
    return (r["cgroup_cap"] - r["anon_peak"]) / layer


def figure(results: list[dict], layer: int, checkpoint_bytes: int, path: str) -> str | None:
    """Reads per forward (over the checkpoint), seconds per forward and the forward over its limit (the
    larger of the uncapped forward and the disk time for what it read) against the room in layers, one
    line per contender; None (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom, third) = plt.subplots(3, 1, figsize=(7, 8.5), sharex=True)
    for contender in dict.fromkeys(r["contender"] for r in results):
        done = [r for r in results if r["contender"] == contender and r.get("outcome") == "yes"
                and room_in_layers(r, layer) is not None]
        done.sort(key=lambda r: room_in_layers(r, layer))
        xs = [room_in_layers(r, layer) for r in done]
        top.plot(xs, [r["read_bytes_per_forward"] / checkpoint_bytes for r in done], marker="o", label=contender)
        bottom.plot(xs, [r["forward_s_mean"] for r in done], marker="o", label=contender)
        limited = [r for r in done if r.get("forward_over_limit")]
        third.plot([room_in_layers(r, layer) for r in limited], [r["forward_over_limit"] for r in limited],
                   marker="o", label=contender)
    top.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    third.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    third.axhline(1.2, color="grey", linewidth=0.8, linestyle=":")
    third.set_ylabel("forward / limit")
    top.set_ylabel("read per forward (x checkpoint)")
    bottom.set_ylabel("forward (s)")
    third.set_xlabel("room at the peak (layers): the limit less the peak anonymous memory")
    top.legend()
    top.set_title("capped_forward --rooms: bytes read and time per forward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
