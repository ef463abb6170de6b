"""The model ``mapoffload demo`` runs (:func:`model_class`, its checkpoint: :func:`write_checkpoint`)
and what it asks of the machine, checked before anything is written.

The demo's budget must hold what streaming needs at the least, whatever the
budget (:func:`streaming_floor`: one layer's uncached buffer, on the device
path the copier's staging ring, the run's bookkeeping); below that the
library's own buffers alone exceed it, and the check could not tell a copy of
the weights from them, so such a budget is refused with the sizes that would
do (:func:`_check_budget`). The host, the device and the disk must hold the
reference model, its activations and the checkpoint (:func:`_check_room`), in
the folder the checkpoint goes to (:func:`_demo_folder`). ``cfg`` is the run's
:class:`~.demo.DemoConfig` (this module does not import the command).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from .._log import format_bytes
from ..memory.regions import tensor_bytes

if TYPE_CHECKING:
    import torch

# What a run costs beside the model's weights, whatever the budget (measured on
# the CPU for 2 to 200 layers, after the warm-up, with the allocator's freed
# memory given back): Python objects of the load, the manager, its plan and the
# placeholders, about 1.5-2 KiB a tensor, and 0.1-0.2 MiB besides. Allowed at
# twice that and more.
BOOKKEEPING_BYTES = 1 << 20
BOOKKEEPING_PER_TENSOR_BYTES = 4 << 10
# The uncached buffers (``pagecache/uncached_read.py``) grow in 2 MiB steps.
UNCACHED_QUANTUM = 2 << 20


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


def _block_bytes(Model, width: int) -> tuple[int, int]:
    """(bytes, tensors) of one block's weights, from a block built on meta."""
    import torch

    with torch.device("meta"):
        block = Model(1, width).blocks[0]
    params = list(block.parameters())
    return sum(tensor_bytes(p) for p in params), len(params)


def streaming_floor(mode: str, layer_bytes: int, tensors: int) -> list[tuple[str, int]]:
    """What streaming needs of host memory at the least, whatever the budget, as (what, bytes).

    With a budget that leaves no page cache to plan, the library streams one
    layer at a time: read uncached into one buffer (when the
    folder takes ``O_DIRECT``: counted anyway), on the device path copied
    through the copier's staging ring into the layer's device buffers (host
    memory in the CPU twin). Plus the run's bookkeeping (``tensors`` in all).
    """
    from ..copier import resolve_settings

    parts = []
    if mode == "cpu twin":
        parts.append(("one layer's twin buffer", layer_bytes))
    parts.append(("its uncached buffer" if parts else "one layer's uncached buffer",
                  _round_up(layer_bytes, UNCACHED_QUANTUM)))
    if mode != "in place":
        _, slot_bytes, slots = resolve_settings()
        parts.append(("the copier's staging ring", slot_bytes * slots))
    parts.append(("bookkeeping", BOOKKEEPING_BYTES + BOOKKEEPING_PER_TENSOR_BYTES * tensors))
    return parts


def _gib_at_least(n: int) -> str:
    """``n`` bytes in GiB, three significant digits, rounded up."""
    import math

    value = n / (1 << 30)
    step = 10 ** (math.floor(math.log10(value)) - 2)
    return f"{math.ceil(value / step) * step:.3g}"


def _judgeable(Model, mode: str, layers: int, width: int) -> bool:
    """Whether half of a ``layers`` x ``width`` checkpoint holds what streaming needs at the least."""
    layer_bytes, tensors = _block_bytes(Model, width)
    floor = sum(n for _, n in streaming_floor(mode, layer_bytes, tensors * layers))
    return layer_bytes * layers // 2 >= floor


def _smallest_width(Model, mode: str, layers: int, width: int) -> int | None:
    """The smallest width from ``width`` up whose default budget the check can judge (None: none up to 2**16)."""
    hi = width
    while not _judgeable(Model, mode, layers, hi):
        hi *= 2
        if hi > 1 << 16:
            return None
    lo = max(width, hi // 2)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _judgeable(Model, mode, layers, mid) else (mid + 1, hi)
    return hi


def _check_budget(cfg, mode: str, layer_bytes: int, tensors: int, Model) -> None:
    """Refuse, before anything is written, a budget the check could not judge.

    The budget must hold what streaming needs at the least (:func:`streaming_floor`);
    below that the library's own buffers alone exceed it, and a copy of the
    weights could not be told from them.
    """
    floor_parts = streaming_floor(mode, layer_bytes, tensors * cfg.layers)
    floor = sum(n for _, n in floor_parts)
    size = layer_bytes * cfg.layers
    budget = int(cfg.host_gib * (1 << 30)) if cfg.host_gib is not None else size // 2
    if budget >= floor:
        return
    args = " ".join(a for a in ("--cpu-twin" if cfg.cpu_twin else "", f"--layers {cfg.layers}",
                                f"--width {cfg.width}") if a)
    what = (f"a {format_bytes(budget)} budget" + ("" if cfg.host_gib is not None
                                                   else f" (half the {format_bytes(size)} checkpoint)"))
    ways = []
    if cfg.host_gib is None:
        # half of L layers >= the floor, whose bookkeeping grows with L too
        fixed = floor - BOOKKEEPING_PER_TENSOR_BYTES * tensors * cfg.layers
        room = layer_bytes / 2 - BOOKKEEPING_PER_TENSOR_BYTES * tensors
        if room > 0:
            ways.append(f"--layers {max(cfg.layers + 1, -(-fixed // int(room)))} or more")
        elif cfg.layers > 2:  # each layer costs more to keep track of than it weighs
            width = _smallest_width(Model, mode, cfg.layers, cfg.width)
            if width is not None:
                ways.append(f"--width {width} or more")
    ways.append(f"--host-gib {_gib_at_least(floor)} or more")
    if mode != "in place":
        ways.append("a smaller staging ring (MAPOFFLOAD_STAGING_MIB, MAPOFFLOAD_STAGING_SLOTS)")
    raise ValueError(
        f"{args}: {what} is below what streaming needs at the least, whatever the budget: {format_bytes(floor)} ("
        + ", ".join(f"{name} {format_bytes(n)}" for name, n in floor_parts)
        + "); the check could not tell a copy of the weights from that: use " + ", or ".join(ways)
    )


def _demo_folder() -> str:
    """Where the checkpoint goes: ``MAPOFFLOAD_DEMO_DIR`` (checked), else the system temp folder."""
    folder = os.path.expanduser(os.environ.get("MAPOFFLOAD_DEMO_DIR") or "")  # "~/x": as the other variables
    if not folder:  # unset or empty: the default, as the other variables
        return tempfile.gettempdir()
    if not os.path.exists(folder):
        raise ValueError(f"MAPOFFLOAD_DEMO_DIR={folder!r}: no such folder")
    if not os.path.isdir(folder):
        raise ValueError(f"MAPOFFLOAD_DEMO_DIR={folder!r}: not a folder")
    return folder


def _check_room(cfg, device, layer_bytes: int, folder: str) -> None:
    """Refuse, before anything is allocated, sizes the host (or device, or disk) cannot hold.

    The reference model is the whole checkpoint in memory, and safetensors'
    ``save_file`` holds a copy of every tensor's bytes while it writes; the
    attention of ``tokens`` rows holds tokens x tokens scores.
    """
    import shutil

    from ..memory.budget import host_memory

    size = layer_bytes * cfg.layers
    acts = 4 * (3 * cfg.tokens * cfg.tokens + 16 * cfg.tokens * cfg.width)
    host = host_memory()
    available = host.machine_available
    if host.cgroup_cap is not None:
        available = min(available, max(0, host.cgroup_cap - (host.cgroup_usage or 0)))
    need = 2 * size + acts
    if need > available:
        raise ValueError(
            f"--layers {cfg.layers} --width {cfg.width} --tokens {cfg.tokens}: the demo needs about "
            f"{format_bytes(need)} of host memory (its reference model (the whole checkpoint, {format_bytes(size)}), "
            f"the copy save_file makes while writing it, activations {format_bytes(acts)}) and the host has "
            f"{format_bytes(available)} available: use smaller --layers, --width or --tokens"
        )
    if device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info(device)[0]
        if size + acts > free:
            raise ValueError(
                f"--layers {cfg.layers} --width {cfg.width} --tokens {cfg.tokens}: the reference model "
                f"({format_bytes(size)}) and activations ({format_bytes(acts)}) do not fit the "
                f"{format_bytes(free)} free on {device}: use smaller --layers, --width or --tokens"
            )
    free = shutil.disk_usage(folder).free
    if size > free:
        raise ValueError(
            f"--layers {cfg.layers} --width {cfg.width}: a {format_bytes(size)} checkpoint does not fit the "
            f"{format_bytes(free)} free in {folder}: use smaller --layers or --width, or set MAPOFFLOAD_DEMO_DIR "
            "to a folder with room"
        )


def model_class():
    """The demo's model class: ``layers`` transformer-like blocks of ``width``, and a non-persistent buffer."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            x = x + self.proj(att @ v)
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class DemoModel(nn.Module):
        def __init__(self, layers: int, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.register_buffer("scale", torch.ones(width), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x * self.scale

    return DemoModel


def write_checkpoint(Model, cfg, path: str, say) -> torch.nn.Module:
    """Step 1: a ``cfg.layers`` x ``cfg.width`` model, its blocks saved to ``path``; returns the model
    (the reference)."""
    from safetensors.torch import save_file

    state = {}
    ref = Model(cfg.layers, cfg.width)
    for i, block in enumerate(ref.blocks):
        for name, p in block.named_parameters():
            state[f"blocks.{i}.{name}"] = p.detach().contiguous()
        say(f"      layer {i + 1}/{cfg.layers} generated")
    save_file(state, path)
    del state
    return ref
