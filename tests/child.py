"""Run a snippet in a fresh interpreter, so that a crash or a hang fails one
test instead of killing or blocking the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_python(code: str, *, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in ``python -c`` from a neutral folder; tests/ is importable.

    A hang past ``timeout`` raises ``subprocess.TimeoutExpired`` (the child is killed).
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, full_env.get("PYTHONPATH")) if p)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir(), env=full_env,
    )


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def reap(pid: int, timeout: float) -> int:
    """Wait for a forked child; its exit code. A child still running after
    ``timeout`` is killed and raises ``SystemExit("child hung")``."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise SystemExit("child hung")
