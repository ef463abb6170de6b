"""The twelve-layer stack most offload tests run: a checkpoint of it (the
``ckpt`` fixture in conftest.py), a model loaded mapped from it, and what the
tests measure about it (reads per forward, residency, the page worker)."""

from __future__ import annotations

import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, drop_page_cache, empty_weights, load_checkpoint, resident_bytes


def save_reference(ref: nn.Module, x: torch.Tensor, path) -> tuple:
    """Save ``ref``'s weights to the safetensors file ``path``: ``(path, x, want)``, ``want``
    the plain model's output for ``x`` (what every offloaded forward must equal)."""
    from safetensors.torch import save_file

    save_file(ref.state_dict(), path)
    with torch.no_grad():
        want = ref(x)
    return path, x, want

MIB = 1 << 20
LAYERS, IN, OUT = 12, 512, 1024  # 2 MiB + 4 KiB a layer, fp32


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(IN, OUT) for _ in range(LAYERS))
        self.mix = nn.Linear(OUT, IN)  # shared between the blocks, outside them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(self.mix(b(x)))
        return x


def mapped(path) -> Stack:
    with empty_weights():
        model = Stack()
    load_checkpoint(model, path, keep_mapping=True)
    return model


def io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def warm_read_bytes(model, x: torch.Tensor, want: torch.Tensor, path, forwards: int = 2) -> float:
    """Bytes one warm forward reads (mean of ``forwards``), after the file's pages were
    dropped and a cold forward read the cached set in; every output checked against ``want``."""
    drop_page_cache(path)
    with torch.no_grad():
        assert torch.equal(model(x), want)  # cold: the cached set is read in
        before = io_read_bytes()
        for _ in range(forwards):
            assert torch.equal(model(x), want)
        return (io_read_bytes() - before) / forwards


def drain(mgr: LayerwiseOffloadManager) -> None:
    """Wait until the page worker did what it was asked (letting go is asynchronous)."""
    mgr.parts.pages.worker.drain()


def layer_resident(mgr: LayerwiseOffloadManager, i: int) -> int:
    hosts = dict(mgr.iter_cpu_weights())  # the slots hold placeholders between forwards
    return sum(resident_bytes([hosts[f"blocks.{i}.weight"], hosts[f"blocks.{i}.bias"]]))


def assert_streamed_not_cached(mgr: LayerwiseOffloadManager) -> None:
    """After the page worker drained: streamed layers read uncached never went through the page cache -
    what is resident of them are bytes in a large folio with a cached neighbour (at most one 2 MiB folio
    at each end of the cached set) - and every cached layer is resident."""
    drain(mgr)
    plan = mgr.residency
    streamed_resident = [layer_resident(mgr, i) for i in plan.streamed]
    assert sum(streamed_resident) <= 2 * (2 << 20), streamed_resident
    for i in plan.cached:
        assert layer_resident(mgr, i) > 0


SQUARE_WIDTH, SQUARE_LAYERS = 512, 8  # 1 MiB a layer (fp32, no bias)


class SquareStack(nn.Module):
    """Eight square layers without bias and nothing outside them (the coordinator's attack tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(SQUARE_WIDTH, SQUARE_WIDTH, bias=False) for _ in range(SQUARE_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def mapped_square(path) -> SquareStack:
    with empty_weights():
        model = SquareStack()
    load_checkpoint(model, path, keep_mapping=True)
    return model
