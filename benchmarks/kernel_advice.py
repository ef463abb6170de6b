"""Reading a cold 64 MiB layer from disk under each page-cache advice path.

The manager keeps faults from reading neighbouring layers with
``MADV_RANDOM``. On kernels where a fault on a ``MADV_HUGEPAGE`` mapping
reads its whole aligned 2 MiB window (5.18+) that is cheap; before (5.14 /
5.15) a fault reads its own 4 KiB page. ``MADV_RANDOM`` without
``MADV_HUGEPAGE`` makes this kernel behave the same way, which is how the
old kernel is simulated here.

Rows (each on the same cold layer, page-aligned but not 2 MiB-aligned
between two 1 MiB neighbours in one file):

- ``window faults``: today's path where the kernel has window faults
  (``MADV_HUGEPAGE`` + ``MADV_RANDOM``, ``MADV_POPULATE_READ``).
- ``old kernel, fault path``: the same code on a kernel without them (what
  5.14 / 5.15 users got before advice by capability).
- ``old kernel, read-ahead path``: what the manager now chooses there
  (``kernel_caps="no-large-folios"``: the layer read ahead whole with
  ``MADV_WILLNEED`` calls as large as the kernel takes, then populated).
- ``old kernel, read-ahead + touch``: the same without
  ``MADV_POPULATE_READ`` (before 5.14): a byte per page read.

Measured: read I/Os completed by the file's block device (machine-wide
``/sys/dev/block/M:m/stat``: other I/O on the disk during a run counts too,
hence the median), bytes this process read from storage
(``/proc/self/io``), wall time, this process's kernel CPU a GB to read the layer and to let it go
(4 KiB pages cost 5-10x what 2 MiB folios do: why chunks are cut at folio boundaries),
``MADV_WILLNEED`` calls, and bytes of the neighbours left resident (should be 0).

Run: python benchmarks/kernel_advice.py [--dir /var/tmp] [--mib 64] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import emit_json, map_private, print_table, unmap
from mapoffload.pagecache import pages
from mapoffload.pagecache.kernel import kernel_caps
from mapoffload.pagecache.mapped_file import MappedFiles
from mapoffload.pagecache.pages import PageWorker, file_extents, layer_spans
from mapoffload._native import _core

MIB = 1 << 20



def disk_reads(dev: int) -> int | None:
    """Reads completed by the block device holding st_dev ``dev``, or None (no such device)."""
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def run_once(path: str, prev: int, layer: int, nxt: int, mode: str) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = prev + layer + nxt
        addr = map_private(fd, size)
        files = MappedFiles()
        try:
            spans = layer_spans([(addr + prev, layer)])
            extents = file_extents(spans, files)
            given = {"window faults": "large-folios",
                     "old kernel, fault path": "large-folios",
                     "old kernel, read-ahead path": "no-large-folios",
                     "old kernel, read-ahead + touch": "no-large-folios,no-populate-read"}[mode]
            worker = PageWorker(given)
            if mode == "old kernel, fault path":
                # Today's code on a 5.15 kernel: it takes the window-fault path, and
                # the kernel reads 4 KiB per fault (no MADV_HUGEPAGE here simulates it).
                caps = worker.caps(extents)
                _core.advise_random(spans, True, False)
            else:
                caps = worker.advise(spans, extents)
            whole = _core.SpanArray([addr, addr + prev, addr + prev + layer], [prev, layer, nxt])
            assert sum(_core.resident_bytes(whole)) == 0, "not cold"
            dev = os.fstat(fd).st_dev
            d0, r0, t0, k0 = disk_reads(dev), read_bytes(), time.perf_counter(), os.times().system
            calls = pages.read_in(spans, "layer", pages.folio_edges(spans) if caps.large_folios else None, caps)
            seconds, k1 = time.perf_counter() - t0, os.times().system
            d1, r1 = disk_reads(dev), read_bytes()
            before, inside, after = _core.resident_bytes(whole)
            pages.let_go(spans, extents, caps)
            k2 = os.times().system
            worker.close()
            return {
                "seconds": seconds,
                "read_sys_s_per_gb": (k1 - k0) / (layer / 1e9),  # this process's kernel CPU (10 ms ticks)
                "let_go_sys_s_per_gb": (k2 - k1) / (layer / 1e9),
                "disk_reads": None if d0 is None else d1 - d0,
                "read_bytes": r1 - r0,
                "willneed_calls": calls,
                "layer_resident": inside,
                "neighbours_resident": before + after,
            }
        finally:
            files.close()
            unmap(addr, size)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


MODES = ("window faults", "old kernel, fault path", "old kernel, read-ahead path", "old kernel, read-ahead + touch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.environ.get("MAPOFFLOAD_BENCH_DIR", "/var/tmp"),
                    help="a folder on a disk, not tmpfs (default: $MAPOFFLOAD_BENCH_DIR, else /var/tmp)")
    ap.add_argument("--mib", type=int, default=64, help="the layer's size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args(argv)

    page = _core.page_size()
    prev, layer, nxt = MIB + 3 * page, args.mib * MIB, MIB + 5 * page
    fd, path = tempfile.mkstemp(prefix="mapoffload-kernel-advice-", suffix=".bin", dir=args.dir)
    try:
        chunk = os.urandom(MIB)
        total = prev + layer + nxt
        with os.fdopen(fd, "wb") as f:
            for _ in range(total // MIB):
                f.write(chunk)
            f.write(chunk[: total % MIB])
            f.flush()
            os.fsync(f.fileno())
        probe_fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(probe_fd, 0, 0, os.POSIX_FADV_DONTNEED)
            here = kernel_caps(probe_fd)
        finally:
            os.close(probe_fd)
        print(f"probe: {here.describe()}")
        dev = os.stat(path).st_dev
        r0 = disk_reads(dev)
        time.sleep(1.0)
        r1 = disk_reads(dev)
        background = None if r0 is None else r1 - r0  # other I/O on the disk, reads per second
        results = {m: [run_once(path, prev, layer, nxt, m) for _ in range(args.repeat)] for m in MODES}
    finally:
        os.unlink(path)

    def med(rs, key):
        vals = [r[key] for r in rs if r[key] is not None]
        return statistics.median(vals) if vals else None

    rows, payload = [], {}
    for m, rs in results.items():
        summary = {k: med(rs, k) for k in rs[0]}
        payload[m] = {"median": summary, "runs": rs}
        d = summary["disk_reads"]
        rows.append([
            m,
            "?" if d is None else f"{d:,.0f}",
            f"{summary['read_bytes'] / MIB:.1f}",
            f"{summary['seconds'] * 1e3:.0f}",
            f"{summary['read_sys_s_per_gb']:.2f} / {summary['let_go_sys_s_per_gb']:.2f}",
            f"{summary['willneed_calls']:.0f}",
            f"{summary['layer_resident'] / MIB:.1f}",
            f"{summary['neighbours_resident'] / 1024:.0f}",
        ])
    print(f"\n{args.mib} MiB cold layer in {args.dir}, median of {args.repeat} (other I/O on the disk before the "
          f"runs: {background} reads/s, counted in read I/Os):\n")
    print_table(["path", "read I/Os", "MiB read", "ms", "kernel s/GB: read / let go", "WILLNEED calls", "layer MiB resident",
                 "neighbours KiB resident"], rows)
    emit_json("kernel_advice", {"dir": args.dir, "layer_mib": args.mib, "repeat": args.repeat,
                                "probe": here.describe(), "background_reads_per_s": background, "results": payload}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
