"""The stand-in CUDA runtime (``tests/fakecuda/fakecudart.c``): build, control, fixtures.

The library is compiled once per source version with the system C compiler
into ``<tmp>/mapoffload-fakecuda-<hash>/libfakecudart.so`` and pointed at by
``MAPOFFLOAD_CUDART``, so the native copier's CUDA path runs on machines
without a GPU. :class:`FakeCuda` drives it through ctypes; because
``dlopen`` of one path returns one handle, the copier and the tests share its
state (streams, memory registry, injected faults, counters).

Fixtures
--------
fakecuda_path
    Session: the built library's path (skips when no C compiler works).
fakecuda
    A :class:`FakeCuda`, reset before and after the test.
fakecuda_runtime
    ``fakecuda``, and a skip unless the native copier opened this library
    (on a GPU machine the copier uses the real runtime).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

ENV = "MAPOFFLOAD_CUDART"
SOURCE = pathlib.Path(__file__).resolve().with_name("fakecuda") / "fakecudart.c"
CFLAGS = ("-std=c11", "-shared", "-fPIC", "-O2", "-pthread", "-Wall")

# cudaError_t values, as the real runtime numbers them.
cudaSuccess = 0
cudaErrorInvalidValue = 1
cudaErrorMemoryAllocation = 2
cudaErrorInitializationError = 3
cudaErrorNoDevice = 100
cudaErrorInvalidDevice = 101
cudaErrorInvalidResourceHandle = 400
cudaErrorNotReady = 600
cudaErrorIllegalAddress = 700
cudaErrorHostMemoryAlreadyRegistered = 712
cudaErrorHostMemoryNotRegistered = 713
cudaErrorLaunchFailure = 719

# cudaMemcpyKind
H2H, H2D, D2H, D2D, DEFAULT = 0, 1, 2, 3, 4
cudaHostAllocPortable = 1
cudaEventDisableTiming = 2
cudaStreamNonBlocking = 1


class FakeCudaUnavailable(RuntimeError):
    """The stand-in cannot be built here (no C compiler, or it failed)."""


class CudaCallError(RuntimeError):
    """A call into the stand-in returned an error code."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} returned {code} ({name})")
        self.call = call
        self.code = code


def find_compiler() -> str | None:
    """``$CC``, else ``cc``, ``gcc`` or ``clang`` from ``PATH``."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cache_dir(digest: str) -> pathlib.Path:
    """A cache folder of ours (never one another user planted)."""
    folder = pathlib.Path(tempfile.gettempdir()) / f"mapoffload-fakecuda-{digest}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return folder
    except OSError:
        pass
    return pathlib.Path(tempfile.mkdtemp(prefix=f"mapoffload-fakecuda-{digest}-"))


_built: pathlib.Path | None = None
_unavailable: str | None = None


def build_library() -> pathlib.Path:
    """Compile the stand-in (cached by source hash); return the ``.so`` path.

    Safe when several test sessions build at once: each compiles to its own
    temporary name, then renames it into place.

    Raises
    ------
    FakeCudaUnavailable
        No C compiler, or the compile failed (its output is in the message).
    """
    global _built, _unavailable
    if _built is not None:
        return _built
    if _unavailable is not None:
        raise FakeCudaUnavailable(_unavailable)
    cc = find_compiler()
    if cc is None:
        _unavailable = "no C compiler (cc, gcc or clang) on PATH to build the stand-in CUDA runtime"
        raise FakeCudaUnavailable(_unavailable)
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join((cc, *CFLAGS)).encode()).hexdigest()[:16]
    folder = _cache_dir(digest)
    lib = folder / "libfakecudart.so"
    if not lib.exists():
        tmp = folder / f".libfakecudart-{os.getpid()}-{uuid.uuid4().hex}.so"
        proc = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            _unavailable = f"building {SOURCE} with {cc} failed:\n{proc.stderr.strip()}"
            raise FakeCudaUnavailable(_unavailable)
        os.replace(tmp, lib)
    _built = lib
    return lib


def use_fake_runtime_if_no_gpu() -> pathlib.Path | None:
    """Point ``MAPOFFLOAD_CUDART`` at the stand-in unless it is set or torch sees a GPU.

    Returns the library's path when it was set, else None (also when it could
    not be built: the tests that need it skip with the reason).
    """
    if os.environ.get(ENV):
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except Exception:  # pragma: no cover - torch is a dependency
        pass
    try:
        lib = build_library()
    except FakeCudaUnavailable:
        return None
    os.environ[ENV] = str(lib)
    return lib


class FakeCuda:
    """ctypes face of the stand-in: its control functions and the CUDA calls tests need.

    The CUDA wrappers raise :class:`CudaCallError` on a non-zero code;
    ``raw`` is the ``ctypes.CDLL`` for calls whose code the test checks.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        self.raw = lib = ctypes.CDLL(str(self.path))
        self._callbacks: list = []
        vp, sz, i, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        pvp = ctypes.POINTER(ctypes.c_void_p)
        sigs = {
            "fakecuda_reset": (None, []),
            "fakecuda_set_delay_us": (None, [u]),
            "fakecuda_set_bandwidth": (None, [ctypes.c_double]),
            "fakecuda_fail": (i, [ctypes.c_char_p, i, i, i]),
            "fakecuda_fail_times": (i, [ctypes.c_char_p, i, i, i, i]),
            "fakecuda_fail_async": (None, [i, i]),
            "fakecuda_enqueue_fill": (i, [vp, vp, i, sz, u]),
            "fakecuda_enqueue_host_op": (i, [vp, vp, vp]),
            "fakecuda_hold": (i, [vp, ctypes.c_ulonglong]),
            "fakecuda_release": (None, [i]),
            "fakecuda_set_strict": (None, [i]),
            "fakecuda_set_fork_check": (None, [i]),
            "fakecuda_set_device_count": (None, [i]),
            "fakecuda_set_pageable_sync": (None, [i]),
            "fakecuda_stat": (ctypes.c_longlong, [ctypes.c_char_p]),
            "cudaGetDeviceCount": (i, [ctypes.POINTER(i)]),
            "cudaSetDevice": (i, [i]),
            "cudaGetDevice": (i, [ctypes.POINTER(i)]),
            "cudaMalloc": (i, [pvp, sz]),
            "cudaFree": (i, [vp]),
            "cudaHostAlloc": (i, [pvp, sz, u]),
            "cudaFreeHost": (i, [vp]),
            "cudaHostRegister": (i, [vp, sz, u]),
            "cudaHostUnregister": (i, [vp]),
            "cudaMemcpy": (i, [vp, vp, sz, i]),
            "cudaMemcpyAsync": (i, [vp, vp, sz, i, vp]),
            "cudaStreamCreate": (i, [pvp]),
            "cudaStreamCreateWithFlags": (i, [pvp, u]),
            "cudaStreamDestroy": (i, [vp]),
            "cudaStreamSynchronize": (i, [vp]),
            "cudaStreamQuery": (i, [vp]),
            "cudaStreamWaitEvent": (i, [vp, vp, u]),
            "cudaEventCreate": (i, [pvp]),
            "cudaEventCreateWithFlags": (i, [pvp, u]),
            "cudaEventRecord": (i, [vp, vp]),
            "cudaEventQuery": (i, [vp]),
            "cudaEventSynchronize": (i, [vp]),
            "cudaEventDestroy": (i, [vp]),
            "cudaDeviceSynchronize": (i, []),
            "cudaGetLastError": (i, []),
            "cudaPeekAtLastError": (i, []),
            "cudaGetErrorString": (ctypes.c_char_p, [i]),
            "cudaGetErrorName": (ctypes.c_char_p, [i]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    # -- errors ---------------------------------------------------------------------
    def error_name(self, code: int) -> str:
        return self.raw.cudaGetErrorName(code).decode()

    def error_string(self, code: int) -> str:
        return self.raw.cudaGetErrorString(code).decode()

    def _check(self, call: str, code: int) -> None:
        if code != cudaSuccess:
            raise CudaCallError(call, code, self.error_name(code))

    def get_last_error(self) -> int:
        return self.raw.cudaGetLastError()

    def peek_at_last_error(self) -> int:
        return self.raw.cudaPeekAtLastError()

    # -- control --------------------------------------------------------------------
    def reset(self) -> None:
        """Drain every stream; clear faults, sticky errors, counters and settings."""
        self.raw.fakecuda_reset()
        self._callbacks.clear()

    def set_delay_us(self, us: int) -> None:
        """Delay before each copy the engine executes."""
        self.raw.fakecuda_set_delay_us(us)

    def set_bandwidth(self, bytes_per_s: float) -> None:
        """Copy engine bandwidth (0: unlimited)."""
        self.raw.fakecuda_set_bandwidth(bytes_per_s)

    def fail(self, func: str, after: int = 0, error: int = cudaErrorLaunchFailure, sticky: bool = False,
             times: int = 1) -> None:
        """Call ``after + 1`` of ``func`` (counted from now) fails with ``error``, and ``times - 1`` more (-1: all)."""
        if self.raw.fakecuda_fail_times(func.encode(), after, error, int(sticky), times) != 0:
            raise ValueError(f"cannot inject a failure into {func!r} (unknown function or too many rules)")

    def fail_async(self, error: int = cudaErrorIllegalAddress, sticky: bool = False) -> None:
        """The next copy the engine executes does not land and reports ``error`` at the next sync call."""
        self.raw.fakecuda_fail_async(error, int(sticky))

    def set_strict(self, on: bool) -> None:
        """Check that copies go host -> device memory (on by default)."""
        self.raw.fakecuda_set_strict(int(on))

    def set_fork_check(self, on: bool) -> None:
        """Every call in a forked child returns cudaErrorInitializationError (on by default)."""
        self.raw.fakecuda_set_fork_check(int(on))

    def set_device_count(self, n: int) -> None:
        self.raw.fakecuda_set_device_count(n)

    def set_pageable_sync(self, on: bool) -> None:
        """Pageable-source async copies sync their stream and stage the source first (on by default)."""
        self.raw.fakecuda_set_pageable_sync(int(on))

    def enqueue_fill(self, stream: int, ptr: int, byte: int, nbytes: int, delay_us: int = 0) -> None:
        """A fake kernel on ``stream``: after ``delay_us``, ``memset(ptr, byte, nbytes)``."""
        self._check("fakecuda_enqueue_fill", self.raw.fakecuda_enqueue_fill(stream, ptr, byte, nbytes, delay_us))

    def enqueue_host_op(self, stream: int, fn) -> None:
        """``fn()`` on the stream's engine thread, in stream order."""
        cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _arg: fn())
        self._callbacks.append(cb)  # alive until reset
        self._check("fakecuda_enqueue_host_op", self.raw.fakecuda_enqueue_host_op(stream, cb, None))

    def stat(self, name: str) -> int:
        """A counter: a CUDA function's calls since reset, or bytes_copied, copies, fills,
        host_ops, pageable_snapshots, pending_ops, max_pending_ops, live_pinned,
        live_pinned_bytes, live_registered, live_device, live_device_bytes,
        live_events, live_streams, async_errors, injected_failures, sticky_error,
        null_stream_uses_devN (calls naming the legacy default stream while device N was current)."""
        v = self.raw.fakecuda_stat(name.encode())
        if v == -1:
            raise KeyError(name)
        return v

    LIVE = ("live_pinned", "live_registered", "live_device", "live_events", "live_streams")

    def live(self) -> dict[str, int]:
        """The live resource counters (for leak checks: compare before and after)."""
        return {k: self.stat(k) for k in self.LIVE}

    # -- CUDA calls -------------------------------------------------------------------
    def _out_ptr(self, call: str, *args) -> int:
        out = ctypes.c_void_p()
        self._check(call, getattr(self.raw, call)(ctypes.byref(out), *args))
        return out.value or 0

    def malloc(self, nbytes: int) -> int:
        return self._out_ptr("cudaMalloc", nbytes)

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self.raw.cudaFree(ptr))

    def host_alloc(self, nbytes: int, flags: int = cudaHostAllocPortable) -> int:
        return self._out_ptr("cudaHostAlloc", nbytes, flags)

    def free_host(self, ptr: int) -> None:
        self._check("cudaFreeHost", self.raw.cudaFreeHost(ptr))

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._check("cudaHostRegister", self.raw.cudaHostRegister(ptr, nbytes, 0))

    def host_unregister(self, ptr: int) -> None:
        self._check("cudaHostUnregister", self.raw.cudaHostUnregister(ptr))

    def stream_create(self, nonblocking: bool = False) -> int:
        return self._out_ptr("cudaStreamCreateWithFlags", cudaStreamNonBlocking if nonblocking else 0)

    def stream_destroy(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self.raw.cudaStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self.raw.cudaStreamSynchronize(stream))

    def stream_query(self, stream: int) -> int:
        return self.raw.cudaStreamQuery(stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cudaStreamWaitEvent", self.raw.cudaStreamWaitEvent(stream, event, 0))

    def event_create(self, flags: int = cudaEventDisableTiming) -> int:
        return self._out_ptr("cudaEventCreateWithFlags", flags)

    def event_record(self, event: int, stream: int = 0) -> None:
        self._check("cudaEventRecord", self.raw.cudaEventRecord(event, stream))

    def event_query(self, event: int) -> int:
        return self.raw.cudaEventQuery(event)

    def event_synchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self.raw.cudaEventSynchronize(event))

    def event_destroy(self, event: int) -> None:
        self._check("cudaEventDestroy", self.raw.cudaEventDestroy(event))

    def device_synchronize(self) -> None:
        self._check("cudaDeviceSynchronize", self.raw.cudaDeviceSynchronize())

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int = DEFAULT) -> None:
        self._check("cudaMemcpy", self.raw.cudaMemcpy(dst, src, nbytes, kind))

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int = H2D, stream: int = 0) -> None:
        self._check("cudaMemcpyAsync", self.raw.cudaMemcpyAsync(dst, src, nbytes, kind, stream))

    def write_device(self, ptr: int, data: bytes) -> None:
        """Synchronous host -> device copy of ``data`` to ``ptr``."""
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        self.memcpy(ptr, ctypes.addressof(buf), len(data), H2D)

    def read_device(self, ptr: int, nbytes: int) -> bytes:
        """Synchronous device -> host read of ``nbytes`` at ``ptr`` (after the work queued on stream 0)."""
        buf = ctypes.create_string_buffer(nbytes)
        self.memcpy(ctypes.addressof(buf), ptr, nbytes, D2H)
        return buf.raw


class Gate:
    """A hold on a stream (see :func:`hold_stream`); ``set()`` releases it."""

    def __init__(self, fake: FakeCuda, gate_id: int) -> None:
        self._fake, self.id = fake, gate_id

    def set(self) -> None:
        self._fake.raw.fakecuda_release(self.id)


def hold_stream(fake: FakeCuda, stream: int, timeout: float = 5) -> Gate:
    """Hold ``stream``: work queued on it after this waits until ``set()`` on the result.

    The hold is native (no Python runs on the engine thread, so it cannot
    deadlock with a caller that synchronizes while holding the GIL) and lapses
    after ``timeout`` seconds, so a test that fails before releasing it ends
    promptly; a reset releases it too.
    """
    gate_id = fake.raw.fakecuda_hold(stream, int(timeout * 1e6))
    if gate_id < 0:
        raise CudaCallError("fakecuda_hold", cudaErrorInvalidValue, "invalid stream or too many holds")
    return Gate(fake, gate_id)


@contextlib.contextmanager
def device_buffer(fake: FakeCuda, nbytes: int) -> Iterator[int]:
    """``cudaMalloc(nbytes)`` for the block, ``cudaFree`` after it; yields the address."""
    ptr = fake.malloc(nbytes)
    try:
        yield ptr
    finally:
        fake.free(ptr)


def read_device(fake: FakeCuda, ptr: int, nbytes: int) -> bytes:
    """The ``nbytes`` at device address ``ptr``, read back synchronously."""
    return fake.read_device(ptr, nbytes)


# Fixtures only under pytest: the scenario children of test_copier_cuda.py import
# this module without paying for pytest's import.
if "pytest" in sys.modules:
    import pytest

    @pytest.fixture(scope="session")
    def fakecuda_path() -> pathlib.Path:
        try:
            return build_library()
        except FakeCudaUnavailable as exc:
            pytest.skip(f"stand-in CUDA runtime unavailable: {exc}")

    @pytest.fixture
    def fakecuda(fakecuda_path) -> Iterator[FakeCuda]:
        fake = FakeCuda(fakecuda_path)
        fake.reset()
        try:
            yield fake
        finally:
            fake.reset()

    @pytest.fixture
    def fakecuda_runtime(fakecuda) -> FakeCuda:
        """The stand-in, checked to be the runtime the native copier opened."""
        if os.environ.get(ENV) != str(fakecuda.path):
            pytest.skip(f"{ENV} does not name the stand-in (a GPU is present or it was set by hand)")
        from mapoffload import _core

        if _core.cuda_runtime_library() != str(fakecuda.path):
            pytest.skip(f"the copier opened {_core.cuda_runtime_library()}, not the stand-in")
        return fakecuda
