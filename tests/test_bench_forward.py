"""benchmarks/capped_forward.py: a forward's CPU split (issue 43: where the CPU of a capped forward goes)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from capped_forward import _cpu_cell, _machine_busy_s  # noqa: E402


def test_the_cpu_cell_is_the_mean_after_the_first_forward():
    row = {"forward_cpu_s": [9.0, 2.0, 4.0], "forward_sys_s": [9.0, 0.25, 0.75], "forward_machine_busy_s": [9.0, 2.5, 4.5]}
    assert _cpu_cell(row) == "3.00 (0.50) / 3.50"
    assert _cpu_cell({"forward_cpu_s": [1.0]}) == "-"  # a row recorded before the split


def test_the_machine_is_busy_while_this_process_computes():
    before, end = _machine_busy_s(), time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert _machine_busy_s() - before >= 0.2  # the clock ticks at 1/SC_CLK_TCK: 0.3 s of our CPU, less a tick or two
