"""Scenarios for test_copier_cuda.py: each runs in a child interpreter.

The child imports this module (no pytest: it starts fast) and calls one
``scenario_*`` function; an assertion error, a crash or a hang fails the
parent's test. Device memory is the stand-in runtime's (host memory it
tracks): destinations are read back with ``ctypes.string_at`` right after
``wait()``, without any synchronisation, so a ``wait()`` that returns before
the bytes landed fails.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import sys
import threading
import time
import weakref

from fakecuda import (
    ENV,
    FakeCuda,
    cudaErrorIllegalAddress,
    cudaErrorLaunchFailure,
    cudaErrorMemoryAllocation,
    cudaErrorNotReady,
    hold_stream,
)

SLOT = 4096
BIG = 1 << 20
BIG_SLOT = 64 * 1024


# --- scenario helpers (child side) ------------------------------------------------------


def _fake() -> FakeCuda:
    fake = FakeCuda(os.environ[ENV])
    fake.reset()
    return fake


def _addr(buf: bytearray) -> int:
    """Address of a bytearray's bytes (the temporary view is dropped: no export kept)."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _copier(mode: str = "staged", threads: int = 3, slots: int = 2, slot_bytes: int = SLOT):
    from mapoffload import _core

    return _core.Copier(device=0, mode=mode, threads=threads, slot_bytes=slot_bytes, slots=slots)


class _Layout:
    """Spans of random bytes and their places in one device buffer (3-byte guard gaps)."""

    GAP = 3

    def __init__(self, fake: FakeCuda, sizes: list[int], seed: int = 0, pinned: list[bool] | None = None):
        rng = random.Random(seed)
        self.fake, self.sizes = fake, sizes
        self.data = [rng.randbytes(n) for n in sizes]
        self.offsets, pos = [], 0
        for n in sizes:
            self.offsets.append(pos)
            pos += n + self.GAP
        self.total = pos
        self.dev = fake.malloc(self.total)
        ctypes.memset(self.dev, 0, self.total)
        self.pinned = pinned or [False] * len(sizes)
        self.keep: list[bytearray] = []
        self.src: list[int] = []
        for d, p in zip(self.data, self.pinned):
            if p:
                ptr = fake.host_alloc(len(d))
                ctypes.memmove(ptr, d, len(d))
                self.src.append(ptr)
            else:
                b = bytearray(d)
                self.keep.append(b)
                self.src.append(_addr(b))
        self.dst = [self.dev + o for o in self.offsets]

    def expected(self) -> bytes:
        out = bytearray(self.total)
        for o, d in zip(self.offsets, self.data):
            out[o : o + len(d)] = d
        return bytes(out)

    def landed(self) -> bytes:
        return ctypes.string_at(self.dev, self.total)

    def free(self) -> None:
        for ptr, p in zip(self.src, self.pinned):
            if p:
                self.fake.free_host(ptr)
        self.fake.free(self.dev)


def _sizes(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([1, 7, 100, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 13, 9000]) for _ in range(count)]


# --- scenarios --------------------------------------------------------------------------


def scenario_contention(mode: str, sources: str) -> None:
    """Many spans >> 2 slots, 3 threads, a slow engine: a slot refilled before the copy
    out of it ran would put wrong bytes at the destination."""
    fake = _fake()
    fake.set_delay_us(2_000)
    sizes = _sizes(1, 40)
    if sources == "pinned":
        pinned = [True] * len(sizes)
    elif sources == "mixed":
        pinned = [i % 3 == 0 for i in range(len(sizes))]
    else:
        pinned = [False] * len(sizes)
    before = fake.live()
    stream = fake.stream_create()
    c = _copier(mode)
    a, b = _Layout(fake, sizes, 1, pinned), _Layout(fake, sizes[::-1], 2, pinned[::-1])
    unstaged = sources != "pageable"
    jobs = [c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep, unstaged=x.pinned if unstaged else None)
            for x in (a, b)]
    for j, x in zip(jobs, (a, b)):
        j.wait()
        assert j.done()
        assert x.landed() == x.expected(), "bytes wrong at the destination (slot reused before its copy finished?)"
    assert c.stats().bytes == 2 * sum(sizes)
    if mode == "staged":
        # The engine read only pinned memory: slots, and the pinned spans sent unstaged.
        assert fake.stat("pageable_snapshots") == 0
    c.close()
    a.free()
    b.free()
    fake.stream_destroy(stream)
    assert fake.live() == before, "pinned slots or events leaked"


def scenario_wait_means_landed(mode: str) -> None:
    fake = _fake()
    fake.set_delay_us(30_000)  # wait() must really wait for the engine
    stream = fake.stream_create()
    c = _copier(mode)
    x = _Layout(fake, [3 * SLOT, 100, SLOT + 1], 3, pinned=[mode == "direct"] * 3)
    opened = hold_stream(fake, stream, timeout=3)
    job = c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)
    time.sleep(0.02)
    assert not job.done()  # nothing can have landed: the stream is held
    opened.set()
    job.wait()
    assert x.landed() == x.expected()  # no synchronisation: wait() means landed
    assert job.done() and job.enqueued()
    c.close()
    x.free()


def scenario_wait_stream(mode: str) -> None:
    """wait_stream: the host waits only for enqueueing; work queued on the consumer
    stream afterwards runs after the copies."""
    fake = _fake()
    copy_stream, consumer = fake.stream_create(), fake.stream_create()
    c = _copier(mode)
    x = _Layout(fake, [SLOT], 4, pinned=[mode == "direct"])  # one unit: fits the ring while held
    opened = hold_stream(fake, copy_stream, timeout=3)
    job = c.submit(x.dst, x.src, x.sizes, copy_stream, keepalive=x.keep)
    waiter = threading.Thread(target=job.wait_stream, args=(consumer,), daemon=True)
    waiter.start()
    waiter.join(1)
    if waiter.is_alive():
        opened.set()
        raise AssertionError("wait_stream blocked until the copy finished")
    assert job.enqueued() and not job.done()
    fake.enqueue_fill(consumer, x.dev, 0x77, SLOT)  # a "kernel" overwriting the destination
    assert fake.stream_query(consumer) == cudaErrorNotReady, "the consumer stream does not wait for the copy"
    opened.set()
    fake.stream_synchronize(consumer)
    assert ctypes.string_at(x.dev, SLOT) == b"\x77" * SLOT, "the consumer stream ran before the copy landed"
    job.wait()
    c.close()
    x.free()


def scenario_wait_for(mode: str, use_wait_for: bool, compute_kind: str = "stream") -> None:
    """wait_for: a fill still pending on a compute stream lands before our copy.

    compute_kind "default": the compute stream is the legacy default stream
    (handle 0, torch's default stream) and the copy stream is non-blocking, as
    torch makes its side streams: nothing but wait_for orders the copy after
    the compute, and handle 0 must not read as "no stream"."""
    fake = _fake()
    if compute_kind == "default":
        copy_stream, compute = fake.stream_create(nonblocking=True), 0
    else:
        copy_stream, compute = fake.stream_create(), fake.stream_create()
    c = _copier(mode)
    x = _Layout(fake, [2 * SLOT + 5], 5, pinned=[mode == "direct"])
    opened = hold_stream(fake, compute, timeout=3)
    fake.enqueue_fill(compute, x.dev, 0x11, x.sizes[0])  # pending "kernel" output
    job = c.submit(x.dst, x.src, x.sizes, copy_stream, keepalive=x.keep, wait_for=compute if use_wait_for else None)
    if use_wait_for:
        time.sleep(0.05)  # a copier ignoring wait_for would land its copy now
        assert not job.done()
        opened.set()
        job.wait()
    else:
        job.wait()
        opened.set()
    fake.device_synchronize()
    got = ctypes.string_at(x.dev, x.sizes[0])
    # Without wait_for the copy lands first and the late fill overwrites it:
    # the control case shows the scenario tells the two apart.
    assert got == (x.data[0] if use_wait_for else b"\x11" * x.sizes[0])
    c.close()
    x.free()


def scenario_ring_fills_before_waiting() -> None:
    """A job that fits the ring is handed to the stream whole while the stream is
    held: a refill takes the slot given back longest ago, never waits for the
    copy just queued out of another while free slots are left."""
    fake = _fake()
    stream = fake.stream_create()
    c = _copier("staged", threads=1, slots=3)
    x = _Layout(fake, [3 * SLOT], 11)  # three units, three slots
    held = hold_stream(fake, stream, timeout=3)
    job = c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)
    deadline = time.monotonic() + 1
    while not job.enqueued() and time.monotonic() < deadline:
        time.sleep(0.005)
    enqueued = job.enqueued()
    held.set()
    job.wait()
    assert enqueued, "the job waited for its own first copy although the ring had free slots"
    assert x.landed() == x.expected()
    c.close()
    x.free()


def scenario_null_stream_device(mode: str) -> None:
    """A copier on device 1 with the default stream (handle 0): every call that names
    stream 0 runs with device 1 current, wait_stream from a thread whose current
    device is 0 (torch leaves it so while a model runs on cuda:1) included."""
    fake = _fake()
    fake.set_device_count(2)
    from mapoffload import _core

    c = _core.Copier(device=1, mode=mode, threads=2, slot_bytes=SLOT, slots=2)
    x = _Layout(fake, [2 * SLOT + 5, 77], 9, pinned=[mode == "direct"] * 2)
    job = c.submit(x.dst, x.src, x.sizes, 0, keepalive=x.keep)
    job.wait_stream(0)
    job.wait()
    assert x.landed() == x.expected()
    c.close()
    on0, on1 = fake.stat("null_stream_uses_dev0"), fake.stat("null_stream_uses_dev1")
    assert on1 > 0, "the copier never named the default stream"
    assert on0 == 0, f"{on0} calls named stream 0 with device 0 current: they ordered the wrong device"
    x.free()


def scenario_no_stale_last_error(mode: str) -> None:
    """A failed or not-ready CUDA call of ours leaves nothing in the calling
    thread's last-error slot, where torch's next launch check
    (cudaGetLastError) would raise it from an unrelated kernel."""
    from mapoffload import _core

    fake = _fake()
    stream = fake.stream_create()
    c = _copier(mode)
    x = _Layout(fake, [SLOT], 10, pinned=[mode == "direct"])  # one unit
    held = hold_stream(fake, stream, timeout=3)
    job = c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)
    job.wait_stream(stream)  # enqueued: the event is recorded, the stream held
    assert not job.done()  # cudaEventQuery: cudaErrorNotReady
    assert c.collect() == 1  # done() again, for the held job
    assert fake.peek_at_last_error() == 0, "cudaErrorNotReady was left as this thread's last error"
    held.set()
    job.wait()
    # A refused call that raises CudaError: the error travels as the exception only.
    fake.fail("cudaEventCreateWithFlags", error=cudaErrorLaunchFailure)
    try:
        c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)
        raise AssertionError("the injected failure did not raise")
    except _core.CudaError:
        pass
    assert fake.peek_at_last_error() == 0, "a failed cudaEventCreateWithFlags was left as the last error"
    buf = bytearray(2 * SLOT)
    _core.host_register(_addr(buf), len(buf))
    try:
        _core.host_register(_addr(buf), len(buf))  # already registered
        raise AssertionError("a second registration did not raise")
    except _core.CudaError:
        pass
    assert fake.peek_at_last_error() == 0, "a refused cudaHostRegister was left as the last error"
    _core.host_unregister(_addr(buf))
    c.close()
    x.free()


def scenario_injected(call: str, after: int, times: int, sticky: bool, mode: str) -> None:
    """A CUDA call of the copier fails: a CudaError naming it, no hang, close() returns,
    nothing leaked (non-sticky); later jobs work (non-sticky) or fail fast (sticky)."""
    from mapoffload import _core

    fake = _fake()
    fake.set_delay_us(1_000)
    stream = fake.stream_create()
    before = fake.live()
    x = _Layout(fake, [2 * SLOT + 5] * 12, 6, pinned=[mode == "direct"] * 12)
    y = _Layout(fake, [SLOT + 3] * 3, 7, pinned=[mode == "direct"] * 3)  # for the job after the failure
    if call == "async":
        fake.fail_async(cudaErrorIllegalAddress, sticky=sticky)
    else:
        error = cudaErrorMemoryAllocation if call == "cudaHostAlloc" else cudaErrorLaunchFailure
        fake.fail(call, after=after, error=error, sticky=sticky, times=times)
    errors, c = [], None
    try:
        c = _copier(mode)
        job = c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)
        deadline = time.monotonic() + 5
        while not job.done() and time.monotonic() < deadline:  # done() never raises
            time.sleep(0.002)
        job.wait()
    except _core.CudaError as exc:
        errors.append(exc)
    hit = fake.stat("async_errors" if call == "async" else "injected_failures")
    if not hit:
        print(f"SKIP: the copier never called {call} in this scenario")
        if c is not None:
            c.close()
        return
    assert errors, f"an injected failure of {call} did not surface as CudaError"
    if call != "async" and not sticky:
        assert call[len("cuda"):] in str(errors[0]), f"the error does not name the call: {errors[0]}"
    elif call != "async":
        # A sticky error fails every later call of every thread: the job may
        # meet it first in another call (as with a real context). It names
        # the call that met it, and the injected error.
        assert f"(error {error})" in str(errors[0]), f"the error is not the injected one: {errors[0]}"
    if c is not None:
        if sticky:
            assert c.broken, "a sticky error must mark the copier broken"
            t0 = time.monotonic()
            try:
                c.submit(y.dst, y.src, y.sizes, stream, keepalive=y.keep).wait()
                raise AssertionError("a job after a sticky error succeeded")
            except _core.CudaError:
                pass
            assert time.monotonic() - t0 < 2, "a job after a sticky error did not fail fast"
        else:
            assert c.broken is None
            # Once the fault stops (after `times` failures, some of which the
            # first job may not have used), jobs work again: nothing was lost.
            for attempt in range(times + 1):
                try:
                    c.submit(y.dst, y.src, y.sizes, stream, keepalive=y.keep).wait()
                    break
                except _core.CudaError:
                    assert attempt < times, "jobs still fail after the injected failures ran out"
            assert y.landed() == y.expected()
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < 5 and c.closed
    if not sticky:  # after a sticky error nothing can be freed, as with the real runtime
        x.free()
        y.free()
        assert fake.live() == before, "pinned slots or events leaked"


def scenario_argument_errors() -> None:
    fake = _fake()
    c = _copier()
    x = _Layout(fake, [SLOT], 8, pinned=[True])
    dev = x.dev
    for dst, src, sizes, what in [
        ([dev], [dev + 10], [100], "overlap"),
        ([x.src[0] + 8], [x.src[0]], [100], "overlap"),
        ([0], [x.src[0]], [10], "null"),
        ([dev], [0], [10], "null"),
        ([dev, dev + 100], [x.src[0]], [10], "length"),
    ]:
        try:
            c.submit(dst, src, sizes, 0)
            raise AssertionError(f"accepted: {what}")
        except ValueError:
            pass
    c.close()
    x.free()


def scenario_fork() -> None:
    """A child using the copier after fork gets a clear error, never hangs, exits promptly."""
    from mapoffload import _core

    fake = _fake()
    fake.set_delay_us(2_000)
    stream = fake.stream_create()
    c = _copier()
    x = _Layout(fake, [3 * SLOT] * 4, 9)
    c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep).wait()
    inflight = c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)  # workers busy at the fork
    # CPython's own watchdog (dump_traceback_later, set by the runner) makes a
    # forked child hang at exit whatever the child does: the runner's timeout
    # still bounds this scenario.
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep).wait()
            print("child: the copy succeeded", flush=True)
            code = 0 if x.landed() == x.expected() else 3
        except (_core.CudaError, RuntimeError) as exc:
            print(f"child: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(code)  # a plain exit: the copier's destructor runs in the child
    from child import reap

    status = reap(pid, 20)
    assert status == 0, f"the child exited with {status}"
    inflight.wait()
    c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep).wait()  # the parent is unaffected
    assert x.landed() == x.expected()
    c.close()


_GLOBALS: list = []


def scenario_exit_in_flight(mode: str, drop: str) -> None:
    """The interpreter exits with copies in flight on a slow engine: exit 0, no crash."""
    fake = _fake()
    fake.set_delay_us(5_000)
    stream = fake.stream_create()
    c = _copier(mode, slot_bytes=BIG_SLOT)
    # 1 MiB sources: malloc maps them apart, so a source freed too early is unmapped.
    x = _Layout(fake, [BIG + 1, BIG + 2, BIG + 3, BIG + 4], 10, pinned=[mode == "direct"] * 4)
    job = c.submit(x.dst, x.src, x.sizes, stream, keepalive=x.keep)
    if drop == "job":
        del job
        x.keep = []  # the copier's keepalive is the only owner of the sources now
        _GLOBALS.append(c)
    elif drop == "copier":
        _GLOBALS.append(job)
        del c
    else:
        _GLOBALS.extend([c, job])
    gc.collect()
    print("exiting", flush=True)


def _check_at_release(obj, block, report: list) -> None:
    ptr, expected = block.ptr, block.expected
    weakref.finalize(obj, lambda: report.append(("src", ctypes.string_at(ptr, len(expected)) == expected)))


class _DeviceBlock:
    """A destination owned by a Python object, as a CUDA tensor owns its memory."""

    def __init__(self, fake: FakeCuda, nbytes: int, expected: bytes, report: list) -> None:
        self.fake, self.ptr, self.expected, self.report = fake, fake.malloc(nbytes), expected, report

    def __del__(self) -> None:
        self.report.append(("dst", ctypes.string_at(self.ptr, len(self.expected)) == self.expected))


def scenario_keepalive(mode: str) -> None:
    """Job handle, sources and destinations dropped before completion: the keepalive holds
    them until every byte landed; the bytes land; nothing crashes."""
    import torch

    fake = _fake()
    fake.set_delay_us(2_000)
    stream = fake.stream_create()
    c = _copier(mode, slot_bytes=BIG_SLOT)
    n = BIG + 17  # big enough that freeing it early unmaps it
    report: list = []
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for _ in range(6)]
    arrays = [bytearray(random.Random(i).randbytes(BIG + i)) for i in range(4)]
    data = [t.numpy().tobytes() for t in tensors] + [bytes(a) for a in arrays]
    blocks = [_DeviceBlock(fake, len(d), d, report) for d in data]
    if mode == "direct":  # direct DMA reads the source late only when it is pinned
        for t in tensors:
            fake.host_register(t.data_ptr(), n)
    for t, b in zip(tensors, blocks):  # a source released early is checked before its bytes landed
        _check_at_release(t, b, report)
    del t, b
    srcs = [t.data_ptr() for t in tensors] + [_addr(a) for a in arrays]
    job = c.submit([b.ptr for b in blocks], srcs, [len(d) for d in data], stream,
                   keepalive=(tensors, arrays, blocks))
    ptrs = [b.ptr for b in blocks]
    del job, tensors, arrays, blocks
    gc.collect()
    junk = [bytearray(b"\xee" * (BIG + 4)) for _ in range(8)] + [torch.full((n,), 0xEE, dtype=torch.uint8)
                                                                 for _ in range(8)]
    c.close()  # waits for device copies in flight too
    gc.collect()
    assert len(report) == len(data) + 6, f"the keepalive was not released after close: {report}"
    assert all(ok for _, ok in report), f"an object was released before its bytes landed: {report}"
    del junk, ptrs
