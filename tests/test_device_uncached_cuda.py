"""The device target reading uncached (``DeviceCopies`` with an ``UncachedSource``) on the CUDA side, through the stand-in runtime (tests/fakecuda):
streamed layers are copied from pinned uncached buffers by DMA (no staging,
no pageable source), a buffer is read into again only after the device copies
from it completed (a held stream proves it), every registration is undone at
close, and a refused registration falls back to staged copies. Each scenario
(tests/device_uncached_scenarios.py) runs in a child interpreter."""

from __future__ import annotations

import pytest

from child import describe, run_python


@pytest.fixture(autouse=True)
def _on_the_stand_in(fakecuda_runtime):
    """Skip unless the native CUDA loader runs on the stand-in (children inherit MAPOFFLOAD_CUDART)."""


def run_scenario(name: str, *args, timeout: float = 60) -> None:
    proc = run_python(
        f"import faulthandler; faulthandler.dump_traceback_later({timeout - 5}, exit=True)\n"
        f"import device_uncached_scenarios as s\ns.scenario_{name}(*{args!r})\n",
        timeout=timeout,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, describe(proc)


def test_a_buffer_goes_back_only_after_the_device_copies_from_it(tmp_path):
    run_scenario("buffer_waits_for_the_device_copies", str(tmp_path))


def test_the_stand_in_catches_a_buffer_given_back_too_early(tmp_path):
    run_scenario("early_release_is_caught", str(tmp_path))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_forwards_on_a_slow_engine(tmp_path, depth):
    run_scenario("forwards", str(tmp_path), depth, True)


def test_a_refused_registration_stages_the_copies(tmp_path):
    run_scenario("forwards", str(tmp_path), 1, False)
