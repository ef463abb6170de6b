"""Shared test setup: the `cuda` marker skips without a device, and the tests
must run against the installed package, not the source folder."""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import signal
import tempfile

import pytest

# Ctrl-C as a user has it, however the suite was started: a shell without job control (a CI script's
# `cmd &`, nohup'd) starts its background jobs with SIGINT ignored, which every child inherits, and a
# Python started so installs no KeyboardInterrupt handler: the tests that send SIGINT to a process
# (a long copy's wait interrupted, `vllm serve` stopped) saw nothing happen. Python's own handler here
# makes the children start with the default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Page-cache peers (other processes under this cgroup: mapoffload.pagecache.peers)
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


MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"}


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding ``path``: the longest mount point
    of /proc/self/mounts that contains it (read here, independently of the
    library's own mount table)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


@pytest.fixture
def tmp_file_dir(tmp_path):
    """A temporary folder on a disk filesystem (not tmpfs), for file mappings.

    pytest's ``tmp_path`` where it is on a disk; else a fresh folder under
    /var/tmp (removed afterwards); skipped where neither is."""
    if filesystem_type(tmp_path) not in MEMORY_FILESYSTEMS:
        yield tmp_path
        return
    base = "/var/tmp"
    if not os.path.isdir(base) or filesystem_type(base) in MEMORY_FILESYSTEMS:
        pytest.skip(f"no disk filesystem for a temporary folder: {tmp_path} and {base} are in memory")
    folder = tempfile.mkdtemp(prefix="mapoffload-test-", dir=base)
    try:
        yield pathlib.Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_page_cache_coordinator(monkeypatch):
    """Each test plans the page cache with a coordinator of its own.

    The coordinator is process-wide: a manager an earlier test dropped
    without ``close()`` stays one of its members until the garbage collector
    frees it (its hooks hold it in a cycle), and its cap, peers and thin
    margin history carry over. A fresh one per test takes all of that out;
    whatever a test leaves open is closed when it ends."""
    from mapoffload.pagecache import coordinator as coordinator_module

    fresh = coordinator_module.PageCacheCoordinator()
    monkeypatch.setattr(coordinator_module, "_COORDINATOR", fresh)
    yield fresh
    for m in fresh.managers():
        try:
            m.close()
        except Exception:  # noqa: BLE001 - a test that broke its manager on purpose
            pass
    fresh.peers.withdraw()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The twelve-layer stack of tests/stacks.py saved to a safetensors file:
    ``(path, x, want)``, ``want`` the plain model's output for ``x``. Modules
    that test another model define a ``ckpt`` of their own."""
    import torch

    from stacks import IN, Stack, save_reference

    torch.manual_seed(0)
    ref = Stack()
    return save_reference(ref, torch.randn(3, IN), tmp_path_factory.mktemp("stack") / "stack.safetensors")
