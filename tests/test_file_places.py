"""The one address -> (file, offset) lookup (``pagecache/file_places.py``): what
it answers, against a pure-Python reading of ``/proc/self/maps``, and one maps
snapshot for a whole manager's layers (each lookup took its own: two a layer)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint
from mapoffload.pagecache.file_places import MapsView
from mapoffload._native import _core

import maps_reference

WIDTH = 256


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _mapped(tmp_path, n: int) -> Stack:
    path = tmp_path / f"stack{n}.safetensors"
    save_file({f"blocks.{i}.weight": torch.full((WIDTH, WIDTH), float(i)) for i in range(n)}, path)
    with empty_weights():
        model = Stack(n)
    load_checkpoint(model, path, keep_mapping=True)
    return model


def test_a_place_is_what_the_maps_line_says(tmp_path):
    model = _mapped(tmp_path, 3)
    with open("/proc/self/maps") as f:
        vmas = maps_reference.parse(f.read())
    maps = MapsView()
    for b in model.blocks:
        addr = b.weight.data_ptr() + 123
        v = next(v for v in vmas if v.start <= addr < v.end)
        place = maps.place(addr)
        assert place is not None and place.path == v.path and place.path.endswith("stack3.safetensors")
        assert (place.dev, place.inode) == (v.dev, v.inode)
        assert place.offset == v.offset + addr - v.start
        assert place.room == v.end - addr
    assert maps.place(0) is None


def _snapshots_to_offload(tmp_path, monkeypatch, n: int) -> int:
    model = _mapped(tmp_path, n)
    calls = []
    real = _core.snapshot

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_core, "snapshot", counted)
    try:
        with LayerwiseOffloadManager(model, "blocks", device="cpu"):
            pass
    finally:
        monkeypatch.setattr(_core, "snapshot", real)
    return len(calls)


def test_one_maps_snapshot_for_every_layer(tmp_path, monkeypatch):
    # The layers' byte runs and folio edges are looked up in one snapshot: how
    # many a manager takes does not grow with its layers.
    assert _snapshots_to_offload(tmp_path, monkeypatch, 2) == _snapshots_to_offload(tmp_path, monkeypatch, 12)
