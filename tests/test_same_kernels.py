"""tests/same_kernels.py, the control the output comparisons rely on: seat_like moves
the reference's weights to the other side's 64-byte offsets, bytes unchanged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from same_kernels import CACHE_LINE, same_threads, seat_like  # noqa: E402


@pytest.mark.parametrize("offset", [0, 8, 32, 56])
def test_seat_like_takes_the_other_sides_offsets_and_keeps_the_values(offset):
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    raw = torch.empty(1024, dtype=torch.float32)
    base = (offset - raw.data_ptr() % CACHE_LINE) % CACHE_LINE // 4
    like = {"weight": raw[base:base + 128].view(8, 16), "bias": raw[base + 256:base + 264]}
    assert like["weight"].data_ptr() % CACHE_LINE == offset
    seat_like(ref, like)
    for k, t in ref.state_dict().items():
        assert t.data_ptr() % CACHE_LINE == like[k].data_ptr() % CACHE_LINE, k
        assert torch.equal(t, want[k]), k
    assert seat_like(ref, like) == 0  # already there: nothing moves


def test_same_threads_fails_when_the_count_changes():
    before = torch.get_num_threads()
    with pytest.raises(AssertionError, match="thread count changed"):
        with same_threads():
            torch.set_num_threads(before + 1)
    torch.set_num_threads(before)
