"""benchmarks/capped_pipeline.py: a pipeline step's limit and its timing hooks (issue 43)."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from capped_pipeline import _timed_steps, table  # noqa: E402

GB = 1e9


def _row(cap, steps, reads, **extra):
    return {"contender": "mapoffload", "cap": cap, "outcome": "yes", "step_s": steps, "step_read_bytes": reads,
            **extra}


def test_the_limit_is_the_larger_of_the_uncapped_step_and_the_disk_time():
    results = [
        _row("none", [0.9, 1.1], [0, 0], image_equal=True),
        _row("+6%", [2.4, 2.4], [2 * GB, 2 * GB], cgroup_cap=600 << 20, image_equal=True),  # disk 2 s: the bound
        _row("+50%", [1.5, 1.5], [GB // 2, GB // 2], cgroup_cap=1000 << 20, image_equal=False),  # the compute's 1 s
        {"contender": "mapoffload", "cap": "+1%", "outcome": "OOM-killed"},
    ]
    rows = table(results, transformer=2 * GB, speed=GB)
    assert results[1]["step_over_limit"] == 1.2 and results[2]["step_over_limit"] == 1.5
    assert results[0]["step_over_limit"] is None  # the uncapped run has no limit of its own
    assert rows[1] == ["mapoffload", "+6%", "yes", "600 MiB", "2.400", "1.00", "2.000", "1.20x", "1.20x", "yes"]
    assert rows[2][-2:] == ["1.50x", "NO"] and rows[2][5] == "0.25"
    assert rows[3][:3] == ["mapoffload", "+1%", "OOM-killed"] and set(rows[3][3:]) == {"-"}


def test_each_call_of_the_module_is_a_step_timed_and_its_reads_counted():
    module = nn.Linear(4, 4)
    row = {"step_s": [], "step_read_bytes": []}
    hooks = _timed_steps(module, row)
    for _ in range(3):
        module(torch.zeros(1, 4))
    for h in hooks:
        h.remove()
    module(torch.zeros(1, 4))  # not counted once removed
    assert len(row["step_s"]) == 3 and all(s >= 0 for s in row["step_s"])
    assert len(row["step_read_bytes"]) == 3 and all(isinstance(b, int) and b >= 0 for b in row["step_read_bytes"])
