"""Shared helpers of the benchmark scripts: timing, tables, JSON, machine info."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED = 4


def map_private(fd: int, size: int) -> int:
    """The address of ``size`` bytes of ``fd`` mapped read-only and private (as a checkpoint is mapped)."""
    addr = _libc.mmap(None, size, 1, 2, fd, 0)  # PROT_READ, MAP_PRIVATE
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return addr


def unmap(addr: int, size: int) -> None:
    _libc.munmap(addr, size)


def unmap_pages(addr: int, size: int) -> None:
    """``MADV_DONTNEED``: this process's pages of the mapping unmapped (the file's can then be dropped)."""
    _libc.madvise(addr, size, MADV_DONTNEED)


def timeit(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except Exception:
        mem = "?"
    return f"{os.cpu_count()} cores, {cpu}, {mem}, Linux {platform.release()}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table: pastes straight into docs/benchmarks.md."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def emit_json(name: str, payload: dict, path: str | None) -> None:
    payload = {"benchmark": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    text = json.dumps(payload, indent=2)
    print("JSON " + json.dumps(payload))
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


class AnonSampler(threading.Thread):
    """Peak RssAnon, sampled every ``interval`` seconds until stop()."""

    def __init__(self, read, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.read, self.interval, self.peak, self.samples = read, interval, read(), 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.peak = max(self.peak, self.read())
            self.samples += 1

    def mark(self) -> int:
        """The peak so far; from here on the peak starts again from the current value."""
        peak = max(self.peak, self.read())
        self.peak = self.read()
        return peak

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, self.read())
        return self.peak


def drop_caches(paths) -> bool:
    """sync + drop the whole page cache (root); where not permitted, only ``paths``' pages. True: all dropped."""
    from mapoffload import drop_page_cache

    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        for path in paths:
            drop_page_cache(path)
        return False


def disk_read(paths) -> dict:
    """The disk's speed the benchmarks turn reads into disk time with: the faster of two cold sequential
    reads of ``paths`` (each dropped from the page cache first) - ``read()`` in 8 MiB calls, and the
    files mapped and populated in 2 MiB folios (``MADV_HUGEPAGE`` + ``MADV_POPULATE_READ``: how the
    manager reads). The first alone moved 0.5-1.7 GB/s between runs on one machine where the second
    gave 2.0 GB/s: a slow measure makes the disk time long and ``/ limit`` look better than it is.
    Returns the bytes, the seconds and GB/s of the faster, and each one's GB/s."""
    from mapoffload import drop_page_cache

    for path in paths:
        drop_page_cache(path)
    total, t0 = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    read_s = time.perf_counter() - t0
    mapped_s = _populate_seconds(paths)
    seconds = min(read_s, mapped_s) if mapped_s else read_s
    return {"disk_bytes": total, "disk_s": seconds, "disk_gb_s": total / seconds / 1e9,
            "disk_gb_s_read": total / read_s / 1e9, "disk_gb_s_mapped": total / mapped_s / 1e9 if mapped_s else None}


def _populate_seconds(paths) -> float | None:
    """Seconds to read ``paths`` cold through a mapping in 2 MiB folios (None where the kernel refuses)."""
    import ctypes
    import mmap

    from mapoffload import drop_page_cache
    from mapoffload._native import _core

    seconds = 0.0
    for path in paths:
        drop_page_cache(path)
        size = os.path.getsize(path)
        if not size:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: nothing reaches the file
        view = ctypes.c_char.from_buffer(mm)
        try:
            spans = _core.SpanArray([ctypes.addressof(view)], [size])
            _core.advise_random(spans, True, True)
            t0 = time.perf_counter()
            err, _ = _core.populate_read(spans)
            seconds += time.perf_counter() - t0
        finally:
            del view
            mm.close()
        if err:
            return None
        drop_page_cache(path)
    return seconds
