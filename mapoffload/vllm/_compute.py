"""How vLLM's CPU backend computes linear layers over the weights: packed or mapped.

After loading, vLLM's CPU backend hands every 2-D linear weight to a GEMM
library (oneDNN, or its small-GEMM kernel) that *packs* it into its own
layout: an owned copy of the weight, the original dropped. That is faster, and
is what happens when host copies fit. When they do not, :func:`mapped_linear`
makes that step keep the parameter (a view of the mapping) and compute with
``torch.nn.functional.linear`` over it: no copy, pages the kernel can drop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@contextlib.contextmanager
def mapped_linear(enabled: bool) -> Iterator[None]:
    """While active (and ``enabled``), vLLM's CPU GEMM dispatch leaves 2-D weights unpacked."""
    if not enabled:
        yield
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = _linear
        return None

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original
