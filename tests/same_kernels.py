"""Comparisons with transformers' or diffusers' own outputs, the kernels' inputs
controlled on both sides.

The CPU matmul kernels pick their summation order by the operands' alignment
and by the thread count: the same bytes at another 64-byte offset can round
differently in the last bit (seen on an AMD EPYC: a Flux image 5.4e-7 off,
its weights at offsets 0 in one load and 32 or 56 in the other). A mapped
weight sits where its file put it (8-byte aligned), an owned copy where the
allocator put it (64-byte aligned); transformers' and diffusers' own loads
leave some weights mapped and copy others. So before a bit-for-bit
comparison the reference's weights are re-seated at the 64-byte offsets of
ours (:func:`seat_like`), and both sides run under one thread count
(:func:`same_threads`). Nothing of ours is moved: what is compared is what
our model computes from where its weights live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

CACHE_LINE = 64  # AVX-512 vectors: the widest alignment a kernel tests for


def host_weights(model: torch.nn.Module, handle: object = None) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` by its name, as our side computes with it:
    its parameters and buffers, and the host tensors of the layers ``handle``
    streams (default: ``model.mapoffload_handle``; for a pipeline's component,
    ``pipe.mapoffload_handle.components[name]``)."""
    out: dict[str, torch.Tensor] = {}
    out.update((k, v) for k, v in model.named_parameters(remove_duplicate=False) if v.device.type == "cpu")
    out.update((k, v) for k, v in model.named_buffers(remove_duplicate=False) if v.device.type == "cpu")
    if handle is None:
        handle = getattr(model, "mapoffload_handle", None)
    for m in getattr(handle, "managers", {}).values():
        out.update(m.iter_cpu_weights())
    return out


def seat_like(ref: torch.nn.Module, like: Mapping[str, torch.Tensor]) -> int:
    """Re-seat ``ref``'s floating-point parameters and buffers at the 64-byte
    offsets of the tensors of the same names in ``like`` (same bytes, new
    owned memory); returns how many were re-seated. Names ``like`` lacks
    stay where they are."""
    moved = 0
    for key, t in [*ref.named_parameters(), *ref.named_buffers()]:
        other = like.get(key)
        if other is None or not t.is_floating_point() or t.device.type != "cpu" or not t.numel():
            continue
        if t.data_ptr() % CACHE_LINE == other.data_ptr() % CACHE_LINE:
            continue
        size = t.element_size()
        buf = torch.empty(t.numel() + 2 * CACHE_LINE // size, dtype=t.dtype)
        start = ((other.data_ptr() - buf.data_ptr()) % CACHE_LINE) // size
        seated = buf[start:start + t.numel()].view(t.shape).copy_(t.detach().contiguous())
        assert seated.data_ptr() % CACHE_LINE == other.data_ptr() % CACHE_LINE
        t.data = seated
        moved += 1
    return moved


@contextlib.contextmanager
def same_threads() -> Iterator[int]:
    """Both sides of a comparison under one torch thread count: whatever
    runs inside must not change it (the kernels split their work by it)."""
    before = torch.get_num_threads()
    yield before
    assert torch.get_num_threads() == before, f"the thread count changed: {before} -> {torch.get_num_threads()}"
