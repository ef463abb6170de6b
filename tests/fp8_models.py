"""What the fp8 tests share: codes and scales of known seeds, transformers'
own dequantization as the reference, and a small stack of fp8 projections."""

from __future__ import annotations

import pytest
import torch

E4M3 = torch.float8_e4m3fn


def transformers_dequant(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' own dequantization (``Fp8Dequantize._dequantize_one``): the reference."""
    pytest.importorskip("transformers")
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(codes, scale, output_dtype=dtype)


def random_codes(shape, seed: int = 0, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """fp8 codes of normal-ish values (no NaN: clamped to the format's range)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(dtype)


def random_scales(shape, seed: int = 1) -> torch.Tensor:
    """float32 block scales around 5e-4."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 1e-3 + 1e-5


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width, bias=False)
        self.down = torch.nn.Linear(2 * width, width, bias=False)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
