"""The stack issue 35's tests stream under a fake room (test_room.py, test_attack_room.py): blocks of
three parts - a norm and two 2 MiB projections - and a linear head outside them."""

from __future__ import annotations

import torch
from torch import nn

from mapoffload import empty_weights, load_checkpoint

W = 512
PART_BYTES = W * 2 * W * 4  # each projection: 2 MiB
LAYER_BYTES = 2 * PART_BYTES + 2 * W * 4  # and the norm's weight and bias


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.up = nn.Linear(W, 2 * W, bias=False)
        self.down = nn.Linear(2 * W, W, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Stack(nn.Module):
    """``blocks`` blocks and a head of ``head`` outputs."""

    def __init__(self, blocks: int, head: int, head_bias: bool = False, head_cls=nn.Linear, block_cls=Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block_cls() for _ in range(blocks))
        self.head = head_cls(W, head, bias=head_bias)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def mapped(path, make) -> nn.Module:
    """``make()`` built on meta and loaded from ``path``'s mapping."""
    with empty_weights():
        model = make()
    load_checkpoint(model, path, keep_mapping=True)
    return model
