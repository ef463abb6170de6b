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
