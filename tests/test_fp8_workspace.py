"""FP8 weights dequantize on the CPU into reused working buffers
(``mapoffload.loading.fp8_workspace``): a buffer is reused only when nothing holds
it, so a weight a caller kept - or a view of it - keeps its values."""

from __future__ import annotations

import gc

import pytest
import torch

from mapoffload.loading import fp8_workspace
from mapoffload.loading.fp8 import attach_fp8, dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.skipif(fp8_workspace._use_count is None, reason="torch has no storage use count")


def _linear(seed: int, rows: int = 256, cols: int = 384) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(cols, rows, bias=False)
    codes, scale = quantize_fp8(lin.weight.detach())
    attach_fp8(lin, "weight", codes, scale, dtype=torch.bfloat16)
    return lin


def _expected(lin: torch.nn.Linear) -> torch.Tensor:
    p = lin.parametrizations.weight
    return dequantize_fp8(p.original, p[0].scale, dtype=torch.bfloat16)


@pytest.fixture(autouse=True)
def _fresh_workspace(monkeypatch):
    # A workspace of this test's own: fp8 modules of other tests still alive own the process's.
    monkeypatch.setattr(fp8_workspace, "_WORKSPACE", fp8_workspace.Workspace())


def test_a_weight_nothing_holds_is_dequantized_into_the_same_buffer():
    lin = _linear(0)
    ws = fp8_workspace.workspace()
    with torch.no_grad():
        first = lin.weight.data_ptr()  # the view is dropped at once
        hits = ws.hits
        second = lin.weight.data_ptr()
    assert first == second and ws.hits == hits + 1
    assert 0 < ws.bytes <= fp8_workspace.PER_KEY * 256 * 384 * 2
    with torch.no_grad():
        assert torch.equal(lin.weight, _expected(lin))


def test_a_kept_weight_or_view_keeps_its_values():
    a, b = _linear(1), _linear(2)  # same shape: one key
    with torch.no_grad():
        kept = a.weight
        view = b.weight.t()  # only a view: the buffer's tensor itself is gone
        want_a, want_b = kept.clone(), view.clone()
        x = torch.randn(3, 384, dtype=torch.bfloat16)
        for _ in range(4):  # every buffer of the key is taken and given back
            a(x), b(x)
            c = _linear(3)
            c(x)
    assert torch.equal(kept, want_a) and torch.equal(view, want_b)


def test_weights_held_at_once_never_share_a_buffer():
    lins = [_linear(s) for s in range(fp8_workspace.PER_KEY + 2)]
    with torch.no_grad():
        held = [lin.weight for lin in lins]
        assert len({w.data_ptr() for w in held}) == len(held)
        for lin, w in zip(lins, held):
            assert torch.equal(w, _expected(lin))


def test_outputs_equal_fresh_memory_over_forwards():
    lin = _linear(4)
    x = torch.randn(5, 384, dtype=torch.bfloat16)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, _expected(lin))
        for _ in range(3):
            assert torch.equal(lin(x), want)


def test_large_weights_get_memory_of_their_own(monkeypatch):
    monkeypatch.setattr(fp8_workspace, "MAX_BUFFER_BYTES", 1024)
    lin = _linear(5)
    with torch.no_grad():
        lin.weight
    assert fp8_workspace.workspace().bytes == 0


def test_the_buffers_go_with_the_last_fp8_weight():
    lin = _linear(6)
    with torch.no_grad():
        lin.weight
    assert fp8_workspace.workspace().bytes > 0
    del lin
    gc.collect()
    assert fp8_workspace.workspace().bytes == 0
