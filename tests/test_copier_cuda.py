"""The native copier's CUDA path, driven through the stand-in runtime (tests/fakecuda).

Every scenario (tests/copier_cuda_scenarios.py) runs in a child interpreter
with a time limit: a crash or a hang fails its test instead of taking the
suite down. The children inherit ``MAPOFFLOAD_CUDART`` from conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


# --- runner (parent side) ------------------------------------------------------------


def run_scenario(name: str, *args, timeout: float = 30) -> str:
    """Run ``scenario_<name>(*args)`` in a child interpreter; return its stdout."""
    code = (
        f"import faulthandler, json, sys; faulthandler.dump_traceback_later({timeout - 5}, exit=True); "
        f"sys.path.insert(0, {TESTS!r}); import copier_cuda_scenarios as t; "
        f"t.scenario_{name}(*json.loads({json.dumps(args)!r}))"
    )
    try:
        # From a neutral folder: the source folder on sys.path would shadow the installed package.
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scenario {name}{args} hung (> {timeout} s)\n{exc.stdout}\n{exc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith("SKIP:"):
            pytest.skip(line[5:].strip())
    if proc.returncode != 0:
        pytest.fail(
            f"scenario {name}{args} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    return proc.stdout


@pytest.fixture(autouse=True)
def _on_the_stand_in(fakecuda_runtime):
    """Skip unless the copier runs on the stand-in (children inherit MAPOFFLOAD_CUDART)."""


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,sources", [("staged", "pageable"), ("direct", "pinned"), ("staged", "mixed")])
def test_byte_exact_under_slot_contention(mode, sources):
    run_scenario("contention", mode, sources)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_wait_means_the_bytes_landed(mode):
    run_scenario("wait_means_landed", mode)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_wait_stream_orders_later_work_after_the_copies(mode):
    run_scenario("wait_stream", mode)


@pytest.mark.parametrize("compute_kind", ["stream", "default"])
@pytest.mark.parametrize("use_wait_for", [True, False])
def test_wait_for_orders_the_copy_after_pending_compute(use_wait_for, compute_kind):
    run_scenario("wait_for", "staged", use_wait_for, compute_kind)


def test_a_job_that_fits_the_ring_is_enqueued_without_waiting_for_the_device():
    run_scenario("ring_fills_before_waiting")


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_default_stream_calls_run_on_the_copier_device(mode):
    run_scenario("null_stream_device", mode)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_no_stale_cuda_error_is_left_for_torch(mode):
    run_scenario("no_stale_last_error", mode)


# (call, calls that succeed first, failures in a row, copier mode). Three failed
# event waits in a row outnumber the two slots: a slot lost on each would hang.
FAILURES = [
    ("cudaHostAlloc", 1, 1, "staged"),
    ("cudaEventCreateWithFlags", 1, 1, "staged"),
    ("cudaMemcpyAsync", 5, 1, "staged"),
    ("cudaMemcpyAsync", 3, 1, "direct"),
    ("cudaEventRecord", 3, 1, "staged"),
    ("cudaEventSynchronize", 2, 3, "staged"),
    ("cudaEventQuery", 0, 1, "staged"),
    ("async", 0, 1, "staged"),
    ("async", 0, 1, "direct"),
]


@pytest.mark.parametrize("sticky", [False, True], ids=["transient", "sticky"])
@pytest.mark.parametrize("call,after,times,mode", FAILURES, ids=[f"{c}-{m}" for c, _, _, m in FAILURES])
def test_injected_cuda_failure(call, after, times, mode, sticky):
    run_scenario("injected", call, after, times, sticky, mode, timeout=20)


def test_argument_errors():
    run_scenario("argument_errors")


def test_fork_child_gets_a_clear_error():
    out = run_scenario("fork")
    assert "child:" in out


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("drop", ["nothing", "job", "copier"])
def test_interpreter_exit_with_copies_in_flight(mode, drop):
    t0 = time.monotonic()
    out = run_scenario("exit_in_flight", mode, drop, timeout=30)
    assert "exiting" in out
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_dropped_handles_and_objects_are_kept_alive_until_landed(mode):
    run_scenario("keepalive", mode, timeout=40)
