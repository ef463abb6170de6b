"""Create a memory cgroup under this process's own cgroup, for tests of
low-memory behaviour. Callers skip when that is not permitted and remove it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator


def _own(controller_v1: str = "memory") -> tuple[str | None, str | None]:
    v2 = v1 = None
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if hid == "0" and ctrls == "":
                v2 = path
            elif controller_v1 in ctrls.split(","):
                v1 = path
    return v2, v1


def _try_v1(name: str, limit: int) -> str | None:
    _, v1 = _own()
    if v1 is None:
        return None
    parent = os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/"))
    if not os.path.isdir(parent):
        return None
    path = os.path.join(parent, name)
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError:
        os.rmdir(path)
        raise
    return path


def _try_v2(name: str, limit: int) -> str | None:
    v2, _ = _own()
    if v2 is None or not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return None
    parent = os.path.join("/sys/fs/cgroup", v2.lstrip("/"))
    with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
        f.write("+memory")
    path = os.path.join(parent, name)
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(limit))
        with open(os.path.join(path, "memory.swap.max"), "w") as f:
            f.write("0")
    except OSError:
        os.rmdir(path)
        raise
    return path


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[str]:
    """Yield the path of a new memory cgroup capped at ``limit_bytes``.

    Raises OSError (callers skip) where cgroups cannot be created here.
    Processes join it by writing their pid to ``<path>/cgroup.procs``.
    """
    name = f"mapoffload-test-{os.getpid()}-{time.monotonic_ns()}"
    path = None
    errors = []
    for attempt in (_try_v2, _try_v1):
        try:
            path = attempt(name, limit_bytes)
        except OSError as exc:
            errors.append(f"{attempt.__name__}: {exc}")
            path = None
        if path:
            break
    if not path:
        raise OSError("cannot create a memory cgroup here: " + "; ".join(errors or ["no memory controller"]))
    try:
        yield path
    finally:
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)
