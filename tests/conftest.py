"""Shared test setup: the `cuda` marker skips without a device, and the tests
must run against the installed package, not the source folder."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

import pytest

# Page-cache peers (other processes under this cgroup: mapoffload._manager.peers)
# are this session's own and its children's: another test run on the same
# machine must not become a rank that splits the budget of this one.
if "MAPOFFLOAD_PEERS_DIR" not in os.environ:
    _peers_dir = tempfile.mkdtemp(prefix="mapoffload-peers-tests-")
    os.environ["MAPOFFLOAD_PEERS_DIR"] = _peers_dir
    _session_pid = os.getpid()

    def _remove_peers_dir() -> None:
        # The session made it and removes it; a forked child running atexit must not.
        if os.getpid() == _session_pid:
            shutil.rmtree(_peers_dir, ignore_errors=True)

    atexit.register(_remove_peers_dir)

# Without a GPU, the copier's CUDA path runs on the stand-in runtime
# (tests/fakecuda): set MAPOFFLOAD_CUDART before anything loads a runtime.
from fakecuda import fakecuda, fakecuda_path, fakecuda_runtime, use_fake_runtime_if_no_gpu  # noqa: F401

use_fake_runtime_if_no_gpu()

import mapoffload  # noqa: E402
from mapoffload import drop_page_cache  # noqa: F401,E402  (tests import it from here)

SOURCE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"mapoffload from {pathlib.Path(mapoffload.__file__).parent}"


@pytest.fixture
def tmp_file_dir(tmp_path):
    """A temporary folder on a disk filesystem (not tmpfs), for file mappings."""
    return tmp_path
