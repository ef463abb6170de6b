"""The stand-in CUDA runtime itself, through ctypes: stream order, events,
legacy stream, strict checks, injected and sticky errors, fork, counters, reset."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import sys
import textwrap
import threading
import time

import pytest

from fakecuda import (
    D2H,
    H2D,
    CudaCallError,
    FakeCuda,
    cudaErrorHostMemoryAlreadyRegistered,
    cudaErrorIllegalAddress,
    cudaErrorInitializationError,
    cudaErrorInvalidDevice,
    cudaErrorInvalidResourceHandle,
    cudaErrorInvalidValue,
    cudaErrorLaunchFailure,
    cudaErrorMemoryAllocation,
    cudaErrorNoDevice,
    cudaErrorNotReady,
    device_buffer,
    hold_stream,
    read_device,
)

N = 4096


def pinned(fake: FakeCuda, data: bytes) -> int:
    ptr = fake.host_alloc(len(data))
    ctypes.memmove(ptr, data, len(data))
    return ptr


def peek(ptr: int, n: int) -> bytes:
    """Device bytes as they are now, without synchronizing (device memory is host memory here)."""
    return ctypes.string_at(ptr, n)


def test_one_library_state_for_every_loader(fakecuda):
    other = FakeCuda(fakecuda.path)  # a second dlopen of the path: the same handle
    fakecuda.raw.cudaGetDeviceCount(ctypes.byref(ctypes.c_int()))
    assert other.stat("cudaGetDeviceCount") == 1


def test_async_copy_runs_later_and_reads_a_pinned_source_late(fakecuda):
    s = fakecuda.stream_create()
    src = pinned(fakecuda, b"A" * N)
    with device_buffer(fakecuda, N) as dev:
        ctypes.memset(dev, 0, N)
        opened = hold_stream(fakecuda, s)
        fakecuda.memcpy_async(dev, src, N, H2D, s)  # returns although the stream is held
        ctypes.memset(src, ord("B"), N)  # refilled before the copy ran: the copy sees it
        assert peek(dev, N) == bytes(N)
        opened.set()
        fakecuda.stream_synchronize(s)
        assert read_device(fakecuda, dev, N) == b"B" * N
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


def test_a_hold_lapses_after_its_timeout(fakecuda):
    s = fakecuda.stream_create()
    t0 = time.monotonic()
    hold_stream(fakecuda, s, timeout=0.05)
    assert fakecuda.stream_query(s) == cudaErrorNotReady
    fakecuda.stream_synchronize(s)
    assert time.monotonic() - t0 >= 0.045
    fakecuda.stream_destroy(s)


def test_copies_wait_for_the_delay(fakecuda):
    fakecuda.set_delay_us(30_000)
    src = pinned(fakecuda, b"A" * N)
    with device_buffer(fakecuda, N) as dev:
        t0 = time.monotonic()
        fakecuda.memcpy_async(dev, src, N, H2D, 0)
        fakecuda.memcpy_async(dev, src, N, H2D, 0)
        fakecuda.stream_synchronize(0)
        assert time.monotonic() - t0 >= 0.058
    fakecuda.free_host(src)


def test_pageable_source_is_staged_when_the_call_returns(fakecuda):
    fakecuda.set_delay_us(30_000)
    src = ctypes.create_string_buffer(b"P" * N, N)
    with device_buffer(fakecuda, N) as dev:
        fakecuda.memcpy_async(dev, ctypes.addressof(src), N, H2D, 0)
        ctypes.memset(src, ord("Q"), N)
        fakecuda.stream_synchronize(0)
        assert read_device(fakecuda, dev, N) == b"P" * N
    assert fakecuda.stat("pageable_snapshots") == 1


def test_events_complete_when_their_stream_reaches_them(fakecuda):
    ev = fakecuda.event_create()
    assert fakecuda.event_query(ev) == 0  # never recorded: complete
    fakecuda.event_synchronize(ev)
    s = fakecuda.stream_create()
    src = pinned(fakecuda, b"x" * N)
    with device_buffer(fakecuda, N) as dev:
        opened = hold_stream(fakecuda, s)
        fakecuda.memcpy_async(dev, src, N, H2D, s)
        fakecuda.event_record(ev, s)
        assert fakecuda.event_query(ev) == cudaErrorNotReady
        assert fakecuda.stream_query(s) == cudaErrorNotReady
        threading.Timer(0.02, opened.set).start()
        fakecuda.event_synchronize(ev)  # blocks until the stream passes the record
        assert fakecuda.event_query(ev) == 0
        assert peek(dev, N) == b"x" * N
    fakecuda.event_destroy(ev)
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


@pytest.mark.parametrize("wait", [True, False])
def test_stream_wait_event_orders_work_across_streams(fakecuda, wait):
    compute, copy = fakecuda.stream_create(), fakecuda.stream_create()
    ev = fakecuda.event_create()
    src = pinned(fakecuda, b"\x22" * N)
    with device_buffer(fakecuda, N) as dev:
        opened = hold_stream(fakecuda, compute)
        fakecuda.enqueue_fill(compute, dev, 0x11, N)
        fakecuda.event_record(ev, compute)
        if wait:
            fakecuda.stream_wait_event(copy, ev)
        fakecuda.memcpy_async(dev, src, N, H2D, copy)
        if not wait:
            fakecuda.stream_synchronize(copy)  # not held by the compute stream
        else:
            assert fakecuda.stream_query(copy) == cudaErrorNotReady
        opened.set()
        fakecuda.device_synchronize()
        # With the wait the copy lands after the fill; without it, before.
        assert peek(dev, N) == (b"\x22" if wait else b"\x11") * N
    fakecuda.event_destroy(ev)
    fakecuda.free_host(src)
    fakecuda.stream_destroy(compute)
    fakecuda.stream_destroy(copy)


def test_operations_of_one_stream_run_in_order(fakecuda):
    s = fakecuda.stream_create()
    src = pinned(fakecuda, b"\x44" * N)
    order = []
    with device_buffer(fakecuda, N) as dev:
        fakecuda.enqueue_fill(s, dev, 0x33, N, delay_us=30_000)
        fakecuda.enqueue_host_op(s, lambda: order.append(peek(dev, 1)))
        fakecuda.memcpy_async(dev, src, N, H2D, s)
        fakecuda.enqueue_host_op(s, lambda: order.append(peek(dev, 1)))
        fakecuda.stream_synchronize(s)
        assert order == [b"\x33", b"\x44"]
        assert peek(dev, N) == b"\x44" * N
    assert fakecuda.stat("fills") == 1 and fakecuda.stat("host_ops") == 2
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


@pytest.mark.parametrize("nonblocking", [False, True])
def test_legacy_default_stream_waits_for_blocking_streams_only(fakecuda, nonblocking):
    s = fakecuda.stream_create(nonblocking=nonblocking)
    src = pinned(fakecuda, b"\x66" * N)
    with device_buffer(fakecuda, N) as dev:
        opened = hold_stream(fakecuda, s)
        fakecuda.enqueue_fill(s, dev, 0x55, N)
        fakecuda.memcpy_async(dev, src, N, H2D, 0)
        if nonblocking:
            fakecuda.stream_synchronize(0)  # stream 0 does not wait for a non-blocking stream
        else:
            assert fakecuda.stream_query(0) == cudaErrorNotReady
        opened.set()
        fakecuda.device_synchronize()
        assert peek(dev, N) == (b"\x55" if nonblocking else b"\x66") * N
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


def test_strict_checks_copy_directions(fakecuda):
    src = pinned(fakecuda, b"s" * N)
    host = ctypes.create_string_buffer(N)
    raw = fakecuda.raw
    with device_buffer(fakecuda, N) as dev:
        assert raw.cudaMemcpyAsync(ctypes.addressof(host), src, N, H2D, None) == cudaErrorInvalidValue
        assert raw.cudaMemcpyAsync(dev + 1, src, N, H2D, None) == cudaErrorInvalidValue  # runs past the end
        assert raw.cudaMemcpyAsync(dev, dev, N, H2D, None) == cudaErrorInvalidValue  # device source
        assert raw.cudaMemcpyAsync(ctypes.addressof(host), dev, N, D2H, None) == 0
        fakecuda.set_strict(False)
        fakecuda.memcpy_async(ctypes.addressof(host), src, N, H2D, 0)
        fakecuda.stream_synchronize(0)
        assert host.raw == b"s" * N
    fakecuda.free_host(src)


def test_registry_rejects_bad_frees_and_double_registration(fakecuda):
    buf = ctypes.create_string_buffer(N)
    raw = fakecuda.raw
    assert raw.cudaFree(ctypes.addressof(buf)) == cudaErrorInvalidValue
    assert raw.cudaFreeHost(ctypes.addressof(buf)) == cudaErrorInvalidValue
    fakecuda.host_register(ctypes.addressof(buf), N)
    assert raw.cudaHostRegister(ctypes.addressof(buf) + 8, 8, 0) == cudaErrorHostMemoryAlreadyRegistered
    assert fakecuda.stat("live_registered") >= 1
    fakecuda.host_unregister(ctypes.addressof(buf))
    assert raw.cudaStreamSynchronize(0xDEAD000) == cudaErrorInvalidResourceHandle
    assert raw.cudaEventQuery(0xDEAD000) == cudaErrorInvalidResourceHandle


def test_devices(fakecuda):
    n = ctypes.c_int()
    assert fakecuda.raw.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value == 1
    assert fakecuda.raw.cudaSetDevice(1) == cudaErrorInvalidDevice
    fakecuda.set_device_count(2)
    assert fakecuda.raw.cudaSetDevice(1) == 0
    assert fakecuda.raw.cudaGetDevice(ctypes.byref(n)) == 0 and n.value == 1
    fakecuda.set_device_count(0)
    assert fakecuda.raw.cudaGetDeviceCount(ctypes.byref(n)) == cudaErrorNoDevice


def test_failure_after_n_calls_then_fine(fakecuda):
    fakecuda.fail("cudaMalloc", after=2, error=cudaErrorMemoryAllocation)
    ptrs = [fakecuda.malloc(64), fakecuda.malloc(64)]
    with pytest.raises(CudaCallError) as info:
        fakecuda.malloc(64)
    assert info.value.code == cudaErrorMemoryAllocation
    assert fakecuda.peek_at_last_error() == cudaErrorMemoryAllocation
    assert fakecuda.get_last_error() == cudaErrorMemoryAllocation
    assert fakecuda.get_last_error() == 0  # read and cleared
    ptrs.append(fakecuda.malloc(64))
    for p in ptrs:
        fakecuda.free(p)
    assert fakecuda.stat("cudaMalloc") == 4
    assert fakecuda.stat("injected_failures") == 1


def test_repeated_failures(fakecuda):
    fakecuda.fail("cudaEventCreateWithFlags", after=1, error=cudaErrorLaunchFailure, times=-1)
    ev = fakecuda.event_create()
    for _ in range(3):
        with pytest.raises(CudaCallError):
            fakecuda.event_create()
    fakecuda.event_destroy(ev)
    with pytest.raises(ValueError, match="cudaNoSuchCall"):
        fakecuda.fail("cudaNoSuchCall")


def test_sticky_error_fails_every_later_call_until_reset(fakecuda):
    ev = fakecuda.event_create()
    fakecuda.fail("cudaEventRecord", error=cudaErrorIllegalAddress, sticky=True)
    with pytest.raises(CudaCallError, match="cudaErrorIllegalAddress"):
        fakecuda.event_record(ev)
    for call in (lambda: fakecuda.malloc(8), fakecuda.device_synchronize, lambda: fakecuda.event_destroy(ev)):
        with pytest.raises(CudaCallError) as info:
            call()
        assert info.value.code == cudaErrorIllegalAddress
    assert fakecuda.get_last_error() == cudaErrorIllegalAddress
    assert fakecuda.get_last_error() == cudaErrorIllegalAddress  # sticky: never cleared
    assert fakecuda.stat("sticky_error") == cudaErrorIllegalAddress
    fakecuda.reset()
    assert fakecuda.get_last_error() == 0
    fakecuda.free(fakecuda.malloc(8))
    fakecuda.event_destroy(ev)


def test_sticky_error_releases_blocked_waiters(fakecuda):
    fakecuda.set_delay_us(5_000_000)
    s = fakecuda.stream_create()
    ev = fakecuda.event_create()
    src = pinned(fakecuda, b"z" * N)
    dev = fakecuda.malloc(N)
    fakecuda.memcpy_async(dev, src, N, H2D, s)
    fakecuda.event_record(ev, s)
    codes = []
    waiter = threading.Thread(target=lambda: codes.append(fakecuda.raw.cudaEventSynchronize(ev)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    fakecuda.fail("cudaGetDevice", error=cudaErrorIllegalAddress, sticky=True)
    assert fakecuda.raw.cudaGetDevice(ctypes.byref(ctypes.c_int())) == cudaErrorIllegalAddress
    waiter.join(2)
    assert not waiter.is_alive() and codes == [cudaErrorIllegalAddress]
    t0 = time.monotonic()
    fakecuda.reset()  # the 5 s copy is abandoned by the dead context
    assert time.monotonic() - t0 < 1
    assert peek(dev, N) != b"z" * N
    fakecuda.free(dev)
    fakecuda.free_host(src)
    fakecuda.event_destroy(ev)
    fakecuda.stream_destroy(s)


def test_async_failure_surfaces_at_the_next_sync_once(fakecuda):
    s = fakecuda.stream_create()
    ev = fakecuda.event_create()
    src = pinned(fakecuda, b"a" * N)
    with device_buffer(fakecuda, N) as dev:
        ctypes.memset(dev, 0, N)
        fakecuda.fail_async(cudaErrorIllegalAddress)
        fakecuda.memcpy_async(dev, src, N, H2D, s)  # accepted: the failure is asynchronous
        fakecuda.event_record(ev, s)
        with pytest.raises(CudaCallError) as info:
            fakecuda.event_synchronize(ev)
        assert info.value.code == cudaErrorIllegalAddress
        assert peek(dev, N) == bytes(N)  # did not land
        fakecuda.event_synchronize(ev)  # reported once
        fakecuda.memcpy_async(dev, src, N, H2D, s)
        fakecuda.stream_synchronize(s)
        assert peek(dev, N) == b"a" * N
    assert fakecuda.stat("async_errors") == 1
    fakecuda.event_destroy(ev)
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


def test_sticky_async_failure(fakecuda):
    s = fakecuda.stream_create()
    src = pinned(fakecuda, b"a" * N)
    dev = fakecuda.malloc(N)
    fakecuda.fail_async(cudaErrorLaunchFailure, sticky=True)
    fakecuda.memcpy_async(dev, src, N, H2D, s)
    assert fakecuda.raw.cudaStreamSynchronize(s) == cudaErrorLaunchFailure
    assert fakecuda.raw.cudaStreamQuery(s) == cudaErrorLaunchFailure
    assert fakecuda.raw.cudaMemcpyAsync(dev, src, N, H2D, s) == cudaErrorLaunchFailure
    fakecuda.reset()
    fakecuda.free(dev)
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


def test_counters_track_calls_bytes_pending_and_live_resources(fakecuda):
    before = fakecuda.live()
    s = fakecuda.stream_create()
    ev = fakecuda.event_create()
    src = pinned(fakecuda, b"c" * N)
    dev = fakecuda.malloc(N)
    during = fakecuda.live()
    assert {k: during[k] - before[k] for k in during} == {
        "live_pinned": 1, "live_registered": 0, "live_device": 1, "live_events": 1, "live_streams": 1,
    }
    opened = hold_stream(fakecuda, s)
    for _ in range(5):
        fakecuda.memcpy_async(dev, src, N, H2D, s)
    assert fakecuda.stat("pending_ops") == 5
    opened.set()
    fakecuda.stream_synchronize(s)
    assert fakecuda.stat("max_pending_ops") == 5
    assert fakecuda.stat("pending_ops") == 0
    assert fakecuda.stat("bytes_copied") == 5 * N and fakecuda.stat("copies") == 5
    assert fakecuda.stat("cudaMemcpyAsync") == 5
    fakecuda.free(dev)
    fakecuda.free_host(src)
    fakecuda.event_destroy(ev)
    fakecuda.stream_destroy(s)
    assert fakecuda.live() == before
    with pytest.raises(KeyError):
        fakecuda.stat("no_such_counter")


def test_bandwidth_limits_the_engine(fakecuda):
    fakecuda.set_bandwidth(10e6)  # 10 MB/s: 200 kB take 20 ms
    src = pinned(fakecuda, bytes(200_000))
    with device_buffer(fakecuda, 200_000) as dev:
        t0 = time.monotonic()
        fakecuda.memcpy_async(dev, src, 200_000, H2D, 0)
        fakecuda.stream_synchronize(0)
        assert time.monotonic() - t0 >= 0.018
    fakecuda.free_host(src)


def test_destroyed_stream_and_event_finish_their_work(fakecuda):
    before = fakecuda.live()
    fakecuda.set_delay_us(20_000)
    s = fakecuda.stream_create()
    ev = fakecuda.event_create()
    src = pinned(fakecuda, b"d" * N)
    with device_buffer(fakecuda, N) as dev:
        fakecuda.memcpy_async(dev, src, N, H2D, s)
        fakecuda.event_record(ev, s)
        fakecuda.event_destroy(ev)
        fakecuda.stream_destroy(s)
        assert fakecuda.stat("live_streams") == before["live_streams"]
        assert fakecuda.stat("live_events") == before["live_events"]
        fakecuda.device_synchronize()
        assert peek(dev, N) == b"d" * N
    fakecuda.free_host(src)
    assert fakecuda.live() == before


def test_reset_drains_without_the_delay_and_clears_everything(fakecuda):
    fakecuda.set_delay_us(10_000_000)
    s = fakecuda.stream_create()
    src = pinned(fakecuda, b"r" * N)
    dev = fakecuda.malloc(N)
    for _ in range(3):
        fakecuda.memcpy_async(dev, src, N, H2D, s)
    fakecuda.fail("cudaMalloc", error=cudaErrorMemoryAllocation)
    t0 = time.monotonic()
    fakecuda.reset()
    assert time.monotonic() - t0 < 1
    assert peek(dev, N) == b"r" * N  # drained: the work ran
    assert fakecuda.stat("pending_ops") == 0 and fakecuda.stat("cudaMemcpyAsync") == 0
    fakecuda.free(fakecuda.malloc(8))  # the injected failure is gone
    t0 = time.monotonic()
    fakecuda.memcpy_async(dev, src, N, H2D, s)  # the delay is back to 0
    fakecuda.stream_synchronize(s)
    assert time.monotonic() - t0 < 1
    fakecuda.free(dev)
    fakecuda.free_host(src)
    fakecuda.stream_destroy(s)


def test_threads_on_their_own_streams(fakecuda):
    fakecuda.set_delay_us(1_000)
    errors = []

    def run(seed):
        try:
            s = fakecuda.stream_create()
            data = bytes((seed + i) % 256 for i in range(N))
            src = pinned(fakecuda, data)
            with device_buffer(fakecuda, N) as dev:
                for _ in range(10):
                    fakecuda.memcpy_async(dev, src, N, H2D, s)
                fakecuda.stream_synchronize(s)
                assert read_device(fakecuda, dev, N) == data
            fakecuda.free_host(src)
            fakecuda.stream_destroy(s)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not [t for t in threads if t.is_alive()], "a thread is still waiting on its stream"
    assert not errors


def test_error_names_and_strings(fakecuda):
    assert fakecuda.error_name(cudaErrorIllegalAddress) == "cudaErrorIllegalAddress"
    assert fakecuda.error_string(cudaErrorInitializationError) == "initialization error"
    assert fakecuda.error_name(12345) == "cudaErrorUnknown"


FORK_SCRIPT = textwrap.dedent(
    """
    import ctypes, os, sys
    sys.path.insert(0, {tests!r})
    from fakecuda import FakeCuda, H2D
    fake = FakeCuda({path!r})
    fake.reset()
    fake.set_fork_check({check})
    s = fake.stream_create()
    dev = fake.malloc(64)
    fake.set_delay_us(20_000)
    fake.memcpy_async(dev, fake.host_alloc(64), 64, H2D, s)  # the engine is busy at the fork
    pid = os.fork()
    if pid == 0:
        n = ctypes.c_int()
        codes = [fake.raw.cudaGetDeviceCount(ctypes.byref(n)), fake.raw.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 8),
                 fake.raw.cudaStreamSynchronize(s)]
        if not {check}:
            src = fake.host_alloc(64)
            ctypes.memset(src, 7, 64)
            fake.memcpy_async(dev, src, 64, H2D, s)
            fake.stream_synchronize(s)
            codes.append(ctypes.string_at(dev, 64) == bytes([7]) * 64)
        print(codes, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    fake.stream_synchronize(s)  # the parent is unaffected
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.parametrize("check", [1, 0])
def test_fork_child(fakecuda_path, check):
    script = FORK_SCRIPT.format(tests=os.path.dirname(__file__), path=str(fakecuda_path), check=check)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr
    e = cudaErrorInitializationError
    assert proc.stdout.strip() == (f"[{e}, {e}, {e}]" if check else "[0, 0, 0, True]")
