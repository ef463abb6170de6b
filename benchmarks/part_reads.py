"""The page worker's part reads against the disk's speed, alone and beside a compute (issue 43).

Under a limit a forward reads its streamed layers part by part on the page worker while the parts
before compute; the forward can be no faster than those reads. This reads a file laid out as a stack's
parts (per layer: 4 attention projections and 3 MLP projections, the default ``capped_forward.py``
Llama's 4 and 14 MiB; packed from an odd offset, as safetensors packs them, so that parts share 2 MiB
file windows) cold, three ways:

- ``file``: the whole file mapped and populated in one call (``MADV_HUGEPAGE`` +
  ``MADV_POPULATE_READ``): the disk's speed as ``capped_forward.py`` measures it, the baseline.
- ``parts``: the manager's path: each part read in by ``PageWorker.read_in`` (2 MiB folios inside it,
  the edges it shares with its neighbours into small folios) one part ahead, and let go by
  ``PageWorker.let_go`` once read (the let-gos on their own thread).
- ``windows``: the same parts widened to their whole 2 MiB file windows (no small folios: what parts
  sharing windows would read), a window the next part shares let go with that part.

Each alone, then beside a compute (a thread of this process multiplying 1024 x 3584 matrices on
torch's threads, as a forward computes beside its reads). Columns: GB/s of what was read, over the
``file`` row's; this process's kernel CPU per GB read; the compute's matmuls a second, over its rate
with nothing read.

Run: python benchmarks/part_reads.py [--dir /var/tmp] [--layers 22] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

from _common import emit_json, map_private, print_table, unmap, unmap_pages  # noqa: E402
from mapoffload._native import _core  # noqa: E402
from mapoffload.pagecache.pages import FOLIO_BYTES, PageWorker, folio_edges  # noqa: E402

MIB = 1 << 20
OFFSET = 37 * 1024 + 8  # a header's worth: no part starts on a 2 MiB boundary


def layout(layers: int, attn: int, mlp: int) -> list[tuple[int, int]]:
    """(file offset, bytes) of each part, packed from ``OFFSET`` with a 4 KiB norm between layers."""
    parts, off = [], OFFSET
    for _ in range(layers):
        for n in (attn,) * 4 + (mlp,) * 3:
            parts.append((off, n))
            off += n
        off += 4096
    return parts


def write_file(path: str, size: int) -> None:
    """``size`` bytes of incompressible data, written back to disk."""
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            left -= f.write(block[: min(MIB, left)])
        os.fsync(f.fileno())


def windows(parts: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Each part widened to the 2 MiB file windows it touches."""
    out = []
    for off, n in parts:
        lo, hi = off // FOLIO_BYTES * FOLIO_BYTES, min(size, -(-(off + n) // FOLIO_BYTES) * FOLIO_BYTES)
        out.append((lo, hi - lo))
    return out


class Compute(threading.Thread):
    """Matmuls on torch's threads until stopped; ``rate()`` is how many a second."""

    def __init__(self) -> None:
        import torch

        super().__init__(daemon=True)
        self.a, self.b = torch.randn(128, 1024), torch.randn(1024, 3584)
        self.done, self.stopped, self.t0, self.t1 = 0, threading.Event(), 0.0, 0.0

    def run(self) -> None:
        self.t0 = time.perf_counter()
        while not self.stopped.is_set():
            (self.a @ self.b).sum()
            self.done += 1
        self.t1 = time.perf_counter()

    def rate(self) -> float:
        self.stopped.set()
        self.join()
        return self.done / (self.t1 - self.t0)


class Reads:
    """The file mapped once; each run drops it from the page cache, then reads it one way."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.base = map_private(self.fd, self.size)
        self.whole = _core.SpanArray([self.base], [self.size])
        self.worker = PageWorker()

    def close(self) -> None:
        self.worker.close()
        unmap(self.base, self.size)
        os.close(self.fd)

    def spans(self, off: int, n: int) -> _core.SpanArray:
        return _core.SpanArray([self.base + off], [n])

    def drop(self) -> None:
        unmap_pages(self.base, self.size)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def run(self, how: str, parts: list[tuple[int, int]]) -> tuple[float, float]:
        """Seconds and this process's system CPU seconds to read the file ``how``."""
        self.drop()
        _core.advise_random(self.whole, False)
        sys0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
        if how == "file":
            _core.populate_read(self.whole)
        else:
            self.worker.advise(self.whole)  # MADV_RANDOM (+ MADV_HUGEPAGE where faults read 2 MiB windows)
            self._parts(parts if how == "parts" else windows(parts, self.size), shared=how == "windows")
        self.worker.drain()
        return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0

    def _parts(self, parts: list[tuple[int, int]], shared: bool) -> None:
        """Read each part one ahead, let it go once read (a window the next part shares: with that part)."""
        spans = [self.spans(off, n) for off, n in parts]
        edges = [None if shared else folio_edges(s) for s in spans]
        reads = [self.worker.read_in(spans[0], "part 0", edges[0])]
        for j, (off, n) in enumerate(parts):
            if j + 1 < len(parts):
                reads.append(self.worker.read_in(spans[j + 1], f"part {j + 1}", edges[j + 1]))
            reads[j].result()
            end = min(off + n, parts[j + 1][0]) if shared and j + 1 < len(parts) else off + n
            if end > off:
                self.worker.let_go(self.spans(off, end - off))


def measure(reads: Reads, parts, repeat: int, busy: bool) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for how in ("file", "parts", "windows"):
        runs = []
        for _ in range(repeat):
            compute = Compute() if busy else None
            if compute is not None:
                compute.start()
            seconds, sys_s = reads.run(how, parts)
            runs.append((seconds, sys_s, compute.rate() if compute is not None else None))
        seconds = statistics.median(r[0] for r in runs)
        out[how] = {"seconds": seconds, "sys_s": statistics.median(r[1] for r in runs),
                    "compute_per_s": statistics.median(r[2] for r in runs) if busy else None,
                    "runs_s": [r[0] for r in runs]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="where to write the file (a disk, not tmpfs)")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--attn-mib", type=float, default=4)
    ap.add_argument("--mlp-mib", type=float, default=14)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = layout(args.layers, int(args.attn_mib * MIB), int(args.mlp_mib * MIB))
    size = parts[-1][0] + parts[-1][1] + 4096
    path = os.path.join(args.dir, f"mapoffload-part-reads-{os.getpid()}.bin")
    write_file(path, size)
    reads = Reads(path)
    try:
        idle = Compute()
        idle.start()
        time.sleep(1.0)
        alone_rate = idle.rate()
        results = {"alone": measure(reads, parts, args.repeat, busy=False),
                   "beside a compute": measure(reads, parts, args.repeat, busy=True)}
    finally:
        reads.close()
        os.unlink(path)
    read_bytes = sum(n for _, n in parts)
    rows = []
    for where, rs in results.items():
        base = read_bytes / rs["file"]["seconds"]
        for how, r in rs.items():
            got = (size if how == "file" else read_bytes) / r["seconds"]
            r["gb_s"] = got / 1e9
            rows.append([where, how, f"{got / 1e9:.2f}", f"{got / base:.2f}x", f"{r['sys_s'] / (read_bytes / 1e9):.3f}",
                         "-" if r["compute_per_s"] is None else f"{r['compute_per_s'] / alone_rate:.2f}x"])
    print(f"{len(parts)} parts, {read_bytes / MIB:.0f} MiB; the compute alone: {alone_rate:.0f} matmuls/s")
    print_table(["where", "how", "GB/s", "/ file", "sys s / GB", "compute / alone"], rows)
    emit_json("part_reads", {"layers": args.layers, "parts": len(parts), "read_bytes": read_bytes,
                             "compute_alone_per_s": alone_rate, "results": results}, args.json)


if __name__ == "__main__":
    main()
