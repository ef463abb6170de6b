"""The copier under the paths deployments take: handles and tensors dropped
early, exit and fork with copies in flight, signals and other SIGBUS
handlers, hostile settings and spans. Each risky case runs in a child
interpreter, so a crash or hang fails the test instead of the suite."""

from __future__ import annotations

import signal

import pytest
import torch

from mapoffload import Copier

from child import describe, run_python

BIG = 64 << 20  # bytes: long enough that the copy is still running when the test acts

PRELUDE = """
import gc, os, sys, mmap, signal, threading, time
import torch
from mapoffload import Copier, MappingFaultError
"""

TRUNCATED_READ = """
def truncated_read(copier, folder):
    path = os.path.join(folder, "trunc.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(16 * 4096))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    src = torch.frombuffer(m, dtype=torch.uint8)
    os.truncate(path, 4096)
    try:
        copier.copy([torch.empty_like(src)], [src]).wait()
    except MappingFaultError as e:
        assert e.filename == path, e.filename
        return "raised"
    return "copied"
"""


def check(proc, expect_out: str | None = None, rc: int = 0) -> None:
    assert proc.returncode == rc, describe(proc)
    if expect_out is not None:
        assert expect_out in proc.stdout, describe(proc)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_handle_and_tensors_dropped_before_the_copy_ran(mode):
    proc = run_python(PRELUDE + f"""
c = Copier("cpu", "{mode}", threads=2, staging_bytes=1 << 20, slots=2)
for _ in range(3):
    src = torch.randint(0, 255, ({BIG},), dtype=torch.uint8)
    dst = torch.empty_like(src)
    ref = src[:4096].clone()
    h = c.copy([dst], [src])
    keep = dst[:4096]  # a view keeps the destination's storage
    del h, src, dst
    gc.collect()
    garbage = [torch.ones({BIG}, dtype=torch.uint8) for _ in range(2)]  # reuse what was freed
    del garbage
while c.collect():
    time.sleep(0.01)
assert torch.equal(keep, ref)
c.close()
print("ok")
""")
    check(proc, "ok")


def test_exit_with_copies_in_flight_is_clean():
    proc = run_python(PRELUDE + f"""
c = Copier("cpu", "staged", threads=2, staging_bytes=1 << 20, slots=2)
src = torch.randint(0, 255, ({BIG},), dtype=torch.uint8)
handles = [c.copy([torch.empty_like(src)], [src]) for _ in range(4)]
del src
print("exiting", flush=True)
""", timeout=60)
    check(proc, "exiting")


def test_copier_dropped_with_copies_in_flight():
    proc = run_python(PRELUDE + f"""
c = Copier("cpu", "staged", threads=2, staging_bytes=1 << 20, slots=2)
src = torch.randint(0, 255, ({BIG},), dtype=torch.uint8)
h = c.copy([torch.empty_like(src)], [src])
del c, src
gc.collect()
h.done()  # the job outlives its copier: asking is safe
print("ok")
""")
    check(proc, "ok")


def test_faulthandler_enabled_after_the_copier_does_not_defeat_the_guard(tmp_path):
    proc = run_python(PRELUDE + TRUNCATED_READ + f"""
import faulthandler
c = Copier("cpu", "staged", threads=1, staging_bytes=1 << 16, slots=2)
faulthandler.enable()
print(truncated_read(c, {str(tmp_path)!r}))
print(truncated_read(c, {str(tmp_path)!r}))
""")
    check(proc, "raised\nraised")


def test_faulthandler_enabled_before_and_disabled_after(tmp_path):
    proc = run_python(PRELUDE + TRUNCATED_READ + f"""
import faulthandler
faulthandler.enable()
c = Copier("cpu", "staged", threads=1, staging_bytes=1 << 16, slots=2)
faulthandler.disable()
print(truncated_read(c, {str(tmp_path)!r}))
""")
    check(proc, "raised")


def test_sigbus_sent_with_kill_reaches_the_previous_handler_and_the_guard_stays(tmp_path):
    proc = run_python(PRELUDE + TRUNCATED_READ + f"""
got = []
signal.signal(signal.SIGBUS, lambda s, f: got.append(s))
c = Copier("cpu", "staged", threads=1, staging_bytes=1 << 16, slots=2)
os.kill(os.getpid(), signal.SIGBUS)
time.sleep(0.05)
print("handler", got)
print(truncated_read(c, {str(tmp_path)!r}))
os.kill(os.getpid(), signal.SIGBUS)
time.sleep(0.05)
print("handler", got)
print(truncated_read(c, {str(tmp_path)!r}))
""")
    check(proc)
    assert proc.stdout.split("\n")[:4] == ["handler [7]", "raised", "handler [7, 7]", "raised"], describe(proc)


def test_sigbus_sent_with_kill_and_no_handler_kills_as_without_the_library():
    proc = run_python(PRELUDE + """
c = Copier("cpu", "staged", threads=1, staging_bytes=1 << 16, slots=2)
os.kill(os.getpid(), signal.SIGBUS)
time.sleep(1)
print("survived")
""")
    assert proc.returncode == -signal.SIGBUS, describe(proc)
    assert "survived" not in proc.stdout


def test_thread_creation_failing_is_an_error_not_an_abort():
    proc = run_python(PRELUDE + """
import resource
from mapoffload.memory.budget import rss_anon_bytes
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (96 << 20), resource.RLIM_INFINITY))
try:
    Copier("cpu", "staged", threads=200, staging_bytes=4096, slots=1)
except RuntimeError as e:
    print("error:", e)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
c = Copier("cpu", "staged", threads=2, staging_bytes=4096, slots=1)
a = torch.arange(1000.0); b = torch.empty_like(a)
c.copy([b], [a]).wait()
assert torch.equal(a, b)
print("ok")
""")
    check(proc, "error: could not start copier worker thread")
    assert "ok" in proc.stdout


def test_fork_child_copies_with_fresh_workers_and_exits():
    proc = run_python(PRELUDE + f"""
c = Copier("cpu", "staged", threads=2, staging_bytes=1 << 20, slots=2)
src = torch.randint(0, 255, ({BIG},), dtype=torch.uint8)
inflight = c.copy([torch.empty_like(src)], [src])
pid = os.fork()
if pid == 0:
    code = 0
    try:
        inflight.wait()
        code = 3  # the parent's copy cannot finish here: it must not claim it did
    except RuntimeError as e:
        if "forked" not in str(e):
            code = 4
    a = torch.arange(100000.0); b = torch.empty_like(a)
    c.copy([b], [a]).wait()
    if not torch.equal(a, b):
        code = 5
    sys.exit(code)  # a plain exit: atexit, finalizers, the copier's destructor
from child import reap
code = reap(pid, 30)
inflight.wait()
print("child", code)
""")
    check(proc, "child 0")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"staging_bytes": 2**64 - 1},
        {"staging_bytes": 2**40},
        {"staging_bytes": 0},
        {"threads": 10**6},
        {"slots": 10**9},
        {"slots": -1},
    ],
)
def test_absurd_settings_are_refused(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"^{name} must be in \d+\.\.\d+( bytes)?, got {value}$"):
        Copier("cpu", **kwargs)


def test_overlapping_source_and_destination_are_refused():
    buf = torch.arange(1000, dtype=torch.uint8)
    with Copier("cpu", threads=1, staging_bytes=4096, slots=1) as c:
        with pytest.raises(ValueError, match="span 0: destination overlaps the source of span 0"):
            c.copy([buf[10:110]], [buf[0:100]])
        with pytest.raises(ValueError, match="destination overlaps the destination"):
            c.copy([buf[0:100], buf[50:150]], [torch.zeros(100, dtype=torch.uint8), torch.ones(100, dtype=torch.uint8)])
        other = torch.zeros(100, dtype=torch.uint8)
        with pytest.raises(ValueError, match="span 1: destination overlaps the source of span 0"):
            c.copy([other, buf[0:100]], [buf[50:150], torch.ones(100, dtype=torch.uint8)])
        # Sources may overlap each other.
        d1, d2 = torch.empty(100, dtype=torch.uint8), torch.empty(100, dtype=torch.uint8)
        c.copy([d1, d2], [buf[0:100], buf[50:150]]).wait()
        assert torch.equal(d2, buf[50:150])


def test_close_is_idempotent_and_copy_after_close_fails_clearly():
    c = Copier("cpu", threads=1, staging_bytes=4096, slots=1)
    c.close()
    c.close(cancel=True)
    with pytest.raises(RuntimeError, match="closed"):
        c.copy([torch.empty(10)], [torch.zeros(10)])


def test_ctrl_c_interrupts_a_long_wait_and_the_copy_still_lands():
    proc = run_python(PRELUDE + f"""
c = Copier("cpu", "staged", threads=1, staging_bytes=1 << 20, slots=1)
src = torch.randint(0, 255, ({BIG} * 4,), dtype=torch.uint8)
dst = torch.empty_like(src)
# 40 copies of 256 MiB queued on one worker: seconds of work, whatever the machine.
# On a busy machine the timer's thread can be started (or run) so late that the work ended first:
# that try says nothing of the wait, and is made again. A wait that went on for more than a few of its
# 50 ms slices after the signal was sent, and did not end, fails. The time is taken once the signal is
# sent (a thread starved between taking it and sending would look like a signal the wait ignored).
for attempt in range(5):
    h = [c.copy([dst], [src]) for _ in range(40)][-1]
    sent = []
    threading.Timer(0.05, lambda: (os.kill(os.getpid(), signal.SIGINT), sent.append(time.monotonic()))).start()
    t0 = time.monotonic()
    try:
        h.wait()
        ended = time.monotonic()
        time.sleep(0.5)  # the timer's signal, if it was late, lands here
    except KeyboardInterrupt:
        if h.done():
            continue  # the signal came in after the work ended (in the sleep): not a test of the wait
        print("interrupted after", round(time.monotonic() - t0, 2), "done:", h.done())
        break
    if sent and sent[0] < ended - 0.25:
        print("not interrupted")
        break
h.wait()
assert torch.equal(src, dst)
print("landed")
""")
    check(proc, "landed")
    assert "interrupted after" in proc.stdout and "done: False" in proc.stdout, describe(proc)
