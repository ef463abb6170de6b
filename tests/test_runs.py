"""The one byte-run merge (``mapoffload/_runs.py``), against the bytes themselves:
merged runs cover exactly the bytes of the runs given, none two of them touch,
and with ``align`` no two share an aligned block; copies merge only where they
continue each other on both sides and are of one kind."""

from __future__ import annotations

import random

from mapoffload._runs import merge_copies, merge_runs


def _bytes(runs) -> set[int]:
    return {b for first, end in runs for b in range(first, end)}


def test_runs_cover_the_same_bytes_and_none_touch():
    rng = random.Random(0)
    for _ in range(300):
        runs = [(a, a + rng.randrange(-2, 40)) for a in (rng.randrange(0, 400) for _ in range(rng.randrange(0, 12)))]
        merged = merge_runs(runs)
        assert _bytes(merged) == _bytes(runs)
        assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))  # sorted, neither overlapping nor touching
        assert all(first < end for first, end in merged)


def test_aligned_runs_sharing_a_block_are_one():
    rng = random.Random(1)
    page = 16
    for _ in range(300):
        runs = [(a, a + rng.randrange(1, 40)) for a in (rng.randrange(0, 400) for _ in range(rng.randrange(1, 12)))]
        merged = merge_runs(runs, align=page)
        assert _bytes(merged) <= set(range(min(r[0] for r in merged), max(r[1] for r in merged)))
        assert _bytes(runs) <= _bytes(merged)
        for a, b in zip(merged, merged[1:]):
            assert b[0] > -(-a[1] // page) * page  # the next run starts past the block where this one ends
    assert merge_runs([(0, 10), (12, 20)], align=16) == [[0, 20]]
    assert merge_runs([(0, 10), (16, 20)], align=16) == [[0, 20]]  # right at the next block: one read
    assert merge_runs([(0, 10), (17, 20)], align=16) == [[0, 10], [17, 20]]
    assert merge_runs([(0, 10), (12, 20)]) == [[0, 10], [12, 20]]


def test_copies_merge_only_where_both_sides_continue_in_one_kind():
    assert merge_copies([(0, 100, 8, True), (8, 108, 8, True)]) == [[0, 100, 16, True]]
    assert merge_copies([(0, 100, 8, True), (8, 109, 8, True)]) == [[0, 100, 8, True], [8, 109, 8, True]]
    assert merge_copies([(0, 100, 8, True), (8, 108, 8, False)]) == [[0, 100, 8, True], [8, 108, 8, False]]
    assert merge_copies([(8, 108, 8, "a"), (0, 100, 8, "a")]) == [[8, 108, 8, "a"], [0, 100, 8, "a"]]  # order kept
    assert merge_copies([]) == []
