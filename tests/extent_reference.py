"""Pure-Python reference of a tensor's byte extent (the native definition is
``extract_tensor_spans`` in csrc/spans.cpp). Deliberately simple and obvious."""

from __future__ import annotations

import torch


def extent(t: torch.Tensor) -> tuple[int, int]:
    """(address, nbytes) of the bytes a CPU tensor's strides can reach from data_ptr().

    Empty, meta and non-CPU tensors give (0, 0).
    """
    if t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() == 0:
        return (0, 0)
    elements = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), elements * t.element_size())
