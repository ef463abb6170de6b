"""Tiny modules the tests build and save themselves."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyModel(nn.Module):
    """Transformer-like: embedding, a stack of blocks, a head tied to the embedding."""

    def __init__(self, width: int = 32, layers: int = 4, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("position_ids", torch.arange(16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def saveable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without the tied duplicate (safetensors refuses shared tensors)."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state.pop("head.weight", None)
    return state


IDS = torch.arange(24).reshape(3, 8) % 64  # token ids TinyModel(width=32) takes


def no_grad_forward(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def mixed_model(tmp_path, reference: nn.Module) -> nn.Module:
    """A TinyModel(width=32, layers=4) holding ``reference``'s values in three stores of one dtype.

    Each block: fc weights mapped; norms and biases owned fp32 (converted, as a
    bf16 checkpoint loaded into a model with fp32 norms gives); fc2 of block 1
    non-contiguous."""
    from safetensors.torch import load_file, save_file

    from mapoffload import empty_weights

    path = tmp_path / "w.safetensors"
    state = saveable_state(reference)
    save_file({k: v for k, v in state.items() if k.endswith("fc1.weight") or k.endswith("fc2.weight")}, path)
    mapped = load_file(path)
    with empty_weights():
        model = TinyModel(width=32, layers=4)
    owned = {k: v.clone() for k, v in state.items() if k not in mapped}
    model.load_state_dict({**owned, **mapped}, strict=False, assign=True)
    model.head.weight = model.embed.weight
    w = model.blocks[1].fc2.weight
    model.blocks[1].fc2.weight = torch.nn.Parameter(w.detach().t().contiguous().t())  # same values, strided
    return model


class Pair(torch.nn.Module):
    """A column-parallel linear then a row-parallel one (Megatron's MLP), for ``tp`` ranks."""

    def __init__(self, d: int, h: int, tp: int = 1) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, h // tp)  # weight [h, d]: rows split
        self.down = torch.nn.Linear(h // tp, d, bias=False)  # weight [d, h]: columns split

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


PLAN = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
