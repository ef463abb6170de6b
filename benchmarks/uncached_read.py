"""Streaming a file in layers under a memory cap far below it: through the
mapping, around the page cache (O_DIRECT), or pread + drop (issue 18, "tight
caps read the floor").

Writes a file of ``--mib`` MiB (random bytes) under ``MAPOFFLOAD_BENCH_DIR``
(default /var/tmp; it must be a disk, not tmpfs) and streams it in layers of
``--layer-mib`` MiB, ``--passes`` times (a pass = one "forward" over every
layer), each variant in a fresh process (this script with a hidden
``--child`` mode) in a memory cgroup of its own made under this process's
cgroup (tests/cgroups.py), capped at the child's baseline usage after its
imports + ``--headroom-mib`` (and uncapped, for reference). The file's pages
are dropped before each child (``POSIX_FADV_DONTNEED``; ``drop_caches`` where
permitted).

  a) mapping   mmap (MAP_PRIVATE, as safetensors), MADV_RANDOM|MADV_HUGEPAGE
               over it (as the layerwise manager sets), then per layer
               MADV_POPULATE_READ, use, MADV_COLD+MADV_PAGEOUT
               (``_core.populate_read`` / ``_core.advise_pageout``)
  a0) mapping-readahead  the same without MADV_RANDOM|MADV_HUGEPAGE (the
               kernel's default readahead: what a kernel without large-folio
               faults, or a manager without the advice, gets)
  b) uncached  ``UncachedReader`` (O_DIRECT into 2 reused page-aligned buffers),
               per layer read, use, release
  b') uncached+prefetch  the same, the next layer read (``read_async``) while
               the current one is used
  c) pread     ``UncachedReader(o_direct=False)``: pread, then POSIX_FADV_DONTNEED

"Use" is a checksum of every byte of the layer (int64 sum), the same for every
variant (and compared: the variants must read the same bytes). Reported per
pass: bytes read from storage (``/proc/self/io`` read_bytes: the process's
block-layer reads, O_DIRECT and page faults included; cgroup v2 ``io.stat``
rbytes too where the io controller is on), wall seconds, major faults, the
cgroup's peak. Plus an uncapped sweep of the uncached path's I/O size x threads.

Run (as root, on a machine with cgroups): python benchmarks/uncached_read.py
Skips (message, exit 0, JSON saying why) where memory cgroups cannot be made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))  # cgroups.py

from capped_forward import (  # noqa: E402
    NO_LIMIT,
    _cg_file_cache,
    _cg_oom_kills,
    _cg_peak,
    _cg_set_cap,
    _cg_usage,
    _cg_write,
)

MIB = 1 << 20
VARIANTS = ("mapping", "mapping+prefetch", "mapping-readahead", "uncached", "uncached+prefetch", "pread")
LETTER = {"mapping": "a", "mapping+prefetch": "a'", "mapping-readahead": "a0", "uncached": "b", "uncached+prefetch": "b'",
          "pread": "c"}


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _major_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])


def _cg_rbytes(cgroup: str | None) -> int | None:
    """Sum of rbytes in a v2 cgroup's io.stat (None on v1 or without the io controller)."""
    if not cgroup:
        return None
    try:
        with open(os.path.join(cgroup, "io.stat")) as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        for field in line.split()[1:]:
            k, _, v = field.partition("=")
            if k == "rbytes":
                total += int(v)
    return total


# --- inside a fresh process --------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    if args.cgroup:
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from mapoffload._core import SpanArray, advise_pageout, advise_random, populate_read
    from mapoffload.pagecache.uncached_read import UncachedReader

    torch.set_num_threads(1)  # the checksum; the reads have threads of their own
    size = os.path.getsize(args.file)
    layer = args.layer_mib * MIB
    layers = [(o, min(o + layer, size)) for o in range(0, size, layer)]

    act = args.act_mib * MIB // 8

    def use(t: torch.Tensor) -> int:
        # The layer's "compute": every byte read; with --act-mib, activations
        # allocated and written meanwhile (anonymous memory under the same cap).
        if not act:
            return int(t.view(torch.int64).sum())
        a = torch.ones(act, dtype=torch.int64)
        return int(t.view(torch.int64).sum()) + int(a.sum())

    # The baseline is taken after the imports, before anything the streaming
    # holds: the buffers (uncached, pread) count against the cap as the page
    # cache window (mapping) does.
    fd = os.open(args.file, os.O_RDONLY | os.O_CLOEXEC)
    use(torch.zeros(8, dtype=torch.uint8))
    row: dict = {"variant": args.variant, "cap": args.cap, "file_bytes": size, "layer_bytes": layer,
                 "layers": len(layers), "loadavg_at_start": os.getloadavg()}
    if args.cgroup:
        row["cgroup_usage_after_imports"] = _cg_usage(args.cgroup)
        row["cgroup_file_cache_after_imports"] = _cg_file_cache(args.cgroup)
        # The imports leave hundreds of MiB of library page cache charged to
        # the cgroup: reclaimable, so a cap over it is looser than it reads.
        # Reclaim what can be (v1 memory.force_empty, v2 memory.reclaim)
        # first: the baseline is then what the process keeps using.
        row["cgroup_reclaimed"] = _cg_write(args.cgroup, "memory.force_empty", "0") or _cg_write(
            args.cgroup, "memory.reclaim", str(1 << 40))
        use(torch.ones(1 << 16, dtype=torch.uint8))  # what the passes touch of torch, back in
        row["cgroup_baseline"] = baseline = _cg_usage(args.cgroup)
        row["cgroup_baseline_file_cache"] = _cg_file_cache(args.cgroup)
        if args.cap != "none":
            row["cgroup_cap"] = cap = baseline + int(args.cap) * MIB
            row["cgroup_cap_written"] = _cg_set_cap(args.cgroup, cap)
        # The peak from here on (v1 max_usage_in_bytes, v2 memory.peak take a write as a reset).
        row["cgroup_peak_reset"] = _cg_write(args.cgroup, "memory.max_usage_in_bytes", "0") or _cg_write(
            args.cgroup, "memory.peak", "0")

    reader = mm = base = pool = None
    if args.variant.startswith("mapping"):
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        base = whole.data_ptr()
        if args.variant != "mapping-readahead":  # as the layerwise manager sets: 2 MiB folio reads, no readahead
            advise_random(SpanArray([base], [size]), True)
        pool = ThreadPoolExecutor(max_workers=1)  # as the manager's page worker: reads and let-gos in order
        pool.submit(int).result()
    else:
        reader = UncachedReader(buffers=2, io_bytes=args.io_mib * MIB, threads=args.threads,
                                o_direct=args.variant != "pread")
        f = reader.open(fd, args.file)
        if args.variant == "uncached+prefetch":  # both buffers and the worker thread, made now
            with reader.read(f, 0, layer), reader.read_async(f, 0, layer).result():
                pass
        else:
            reader.read(f, 0, layer).release()
        row.update(method=f.method, why=f.why, io_bytes=reader.io_bytes, threads=reader.threads)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    print("BASE " + json.dumps(row), flush=True)

    def span(k: int) -> SpanArray:
        o, e = layers[k]
        return SpanArray([base + o], [e - o])

    def read_in(k: int) -> None:
        err, _ = populate_read(span(k))
        if err:
            raise OSError(err, "MADV_POPULATE_READ failed")

    row.update(pass_read_bytes=[], pass_cg_rbytes=[], pass_s=[], pass_major_faults=[], checksums=[])
    for _ in range(args.passes):
        io0, rb0, mf0, t0 = _proc_io()["read_bytes"], _cg_rbytes(args.cgroup), _major_faults(), time.perf_counter()
        total = 0
        if args.variant in ("mapping", "mapping-readahead"):
            for k, (o, e) in enumerate(layers):
                read_in(k)
                total += use(whole[o:e])
                advise_pageout(span(k))
        elif args.variant == "mapping+prefetch":
            nxt = pool.submit(read_in, 0)
            for k, (o, e) in enumerate(layers):
                nxt.result()
                if k + 1 < len(layers):
                    nxt = pool.submit(read_in, k + 1)
                total += use(whole[o:e])
                last = pool.submit(advise_pageout, span(k))
            last.result()
        elif args.variant == "uncached+prefetch":
            nxt = reader.read_async(f, *layers[0])
            for k in range(len(layers)):
                buf = nxt.result()
                if k + 1 < len(layers):
                    nxt = reader.read_async(f, *layers[k + 1])
                total += use(buf.tensor())
                buf.release()
        else:
            for o, e in layers:
                with reader.read(f, o, e) as buf:
                    total += use(buf.tensor())
        row["pass_s"].append(time.perf_counter() - t0)
        row["pass_read_bytes"].append(_proc_io()["read_bytes"] - io0)
        rb1 = _cg_rbytes(args.cgroup)
        row["pass_cg_rbytes"].append(None if rb0 is None or rb1 is None else rb1 - rb0)
        row["pass_major_faults"].append(_major_faults() - mf0)
        row["checksums"].append(total & ((1 << 64) - 1))
    if reader is not None:
        row["reader_stats"] = reader.stats()
        reader.close()
    if args.cgroup:
        row["cgroup_peak"] = _cg_peak(args.cgroup)
    print("ROW " + json.dumps(row), flush=True)


def sweep_child(args: argparse.Namespace) -> None:
    """Uncapped: the uncached path's pass time per (io MiB, threads), median of 3 cold passes."""
    import statistics

    import torch

    from mapoffload.pagecache.uncached_read import UncachedReader

    size = os.path.getsize(args.file)
    layer = args.layer_mib * MIB
    rows = []
    for io_mib in (1, 4, 8):
        for threads in (1, 2, 4):
            with UncachedReader(buffers=2, io_bytes=io_mib * MIB, threads=threads) as reader:
                f = reader.open(args.file)
                reader.read(f, 0, layer).release()
                times, reads = [], []
                for _ in range(3):
                    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    io0, t0 = _proc_io()["read_bytes"], time.perf_counter()
                    for o in range(0, size, layer):
                        with reader.read(f, o, min(o + layer, size)) as buf:
                            int(buf.tensor()[:8].view(torch.int64).sum())
                    times.append(time.perf_counter() - t0)
                    reads.append(_proc_io()["read_bytes"] - io0)
                rows.append({"io_mib": io_mib, "threads": threads, "s": statistics.median(times), "s_all": times,
                             "read_bytes": statistics.median(reads), "method": f.method})
    print("SWEEP " + json.dumps(rows), flush=True)


# --- the parent ---------------------------------------------------------------------------------


def _drop(path: str) -> bool:
    from _common import drop_caches

    return drop_caches([path])


def _run_child(extra: list[str], args: argparse.Namespace, cgroup: str | None) -> tuple[int | None, str, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--file", args.file, "--layer-mib",
           str(args.layer_mib), "--passes", str(args.passes), "--act-mib", str(args.act_mib), "--io-mib", str(args.io_mib), "--threads",
           str(args.threads), *extra]
    if cgroup:
        cmd += ["--cgroup", cgroup]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=tempfile.gettempdir())
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return None, out, err


def run(variant: str, headroom: int | None, args: argparse.Namespace) -> dict:
    from cgroups import memory_cgroup

    cold = _drop(args.file)
    extra = ["--child", "--variant", variant, "--cap", "none" if headroom is None else str(headroom)]
    with memory_cgroup(NO_LIMIT) as cgroup:
        rc, out, err = _run_child(extra, args, cgroup)
        oom = _cg_oom_kills(cgroup)
    if os.path.exists(cgroup):
        warnings.warn(f"could not remove the cgroup {cgroup}", stacklevel=1)
    row: dict = {}
    for tag in ("BASE ", "ROW "):
        for line in out.splitlines():
            if line.startswith(tag):
                row.update(json.loads(line[len(tag):]))
    row.update(variant=variant, cap="none" if headroom is None else f"+{headroom} MiB", returncode=rc, cold=cold,
               cgroup_oom_kills=oom, stderr_tail=err.strip().splitlines()[-3:])
    row["outcome"] = ("ok" if rc == 0 and "pass_s" in row else "timeout" if rc is None
                      else "OOM-killed" if rc == -9 or (oom or 0) > 0 else f"failed ({rc})")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=384, help="file size (MiB)")
    ap.add_argument("--layer-mib", type=int, default=16)
    ap.add_argument("--headroom-mib", type=int, nargs="*", default=[48],
                    help="caps: the child's baseline + this (MiB); 'uncapped' runs too unless --no-uncapped")
    ap.add_argument("--no-uncapped", action="store_true")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--act-mib", type=int, default=0, help="activations allocated while each layer is used (MiB)")
    ap.add_argument("--io-mib", type=int, default=4, help="uncached/pread: largest single read")
    ap.add_argument("--threads", type=int, default=2, help="uncached/pread: reads in flight per call")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--dir", default=os.environ.get("MAPOFFLOAD_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sweep-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cap", default="none", help=argparse.SUPPRESS)  # the child's: "none" or headroom MiB
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.sweep_child:
        sweep_child(args)
        return 0

    from _common import emit_json, print_table

    from cgroups import memory_cgroup

    try:
        with memory_cgroup(NO_LIMIT):
            pass
    except OSError as exc:
        print(f"skipped: {exc}")
        emit_json("uncached_read", {"skipped": str(exc)}, args.json)
        return 0

    os.makedirs(args.dir, exist_ok=True)
    fd, args.file = tempfile.mkstemp(prefix="mapoffload-uncached-", suffix=".bin", dir=args.dir)
    rows: list[dict] = []
    sweep: list[dict] = []
    try:
        chunk = os.urandom(MIB)
        with os.fdopen(fd, "wb") as f:
            for k in range(args.mib):
                f.write(chunk[k % 251:] + chunk[:k % 251])  # distinct layers, cheap to make
            f.flush()
            os.fsync(f.fileno())
        caps = ([] if args.no_uncapped else [None]) + list(args.headroom_mib)
        for headroom in caps:
            for variant in args.variants.split(","):
                rows.append(run(variant, headroom, args))
                r = rows[-1]
                print(f"# {variant} cap={r['cap']}: {r['outcome']} read/pass "
                      f"{[round(b / MIB) for b in r.get('pass_read_bytes', [])]} MiB, "
                      f"s/pass {[round(s, 2) for s in r.get('pass_s', [])]}", flush=True)
        if not args.no_sweep:
            _drop(args.file)
            rc, out, err = _run_child(["--sweep-child"], args, None)
            for line in out.splitlines():
                if line.startswith("SWEEP "):
                    sweep = json.loads(line[6:])
            if rc != 0:
                print("sweep failed: " + err.strip()[-500:])
    finally:
        os.unlink(args.file)

    size = args.mib * MIB
    sums = {tuple(r["checksums"]) for r in rows if r.get("checksums")}
    table = []
    for r in rows:
        if r["outcome"] != "ok":
            table.append([f"{LETTER[r['variant']]}) {r['variant']}", r["cap"], r["outcome"], "", "", "", "", ""])
            continue
        reads, secs = r["pass_read_bytes"], r["pass_s"]
        ref_variant = "mapping+prefetch" if r["variant"].endswith("prefetch") else "mapping"
        ref = next((x for x in rows if x["cap"] == r["cap"] and x["variant"] == ref_variant and x["outcome"] == "ok"),
                   None)
        ratio = f"{(sum(secs) / sum(ref['pass_s'])):.2f}" if ref else ""
        peak = r.get("cgroup_peak")
        base = r.get("cgroup_baseline")
        table.append([f"{LETTER[r['variant']]}) {r['variant']}" + (f" ({r['method']})" if r.get("method") and
                                                                   r["method"] != "uncached" and r["variant"] != "pread"
                                                                   else ""),
                      r["cap"], f"{reads[0] / size:.2f}",
                      f"{sum(reads[1:]) / max(len(reads) - 1, 1) / size:.2f}" if len(reads) > 1 else "",
                      f"{secs[0]:.2f}", f"{sum(secs) / len(secs):.2f}", ratio,
                      f"{(peak - base) / MIB:.0f}" if peak is not None and base is not None else ""])
    print()
    print(f"file {args.mib} MiB in layers of {args.layer_mib} MiB, {args.act_mib} MiB activations a layer, "
          f"{args.passes} passes; uncached/pread: "
          f"{args.io_mib} MiB I/Os, {args.threads} threads")
    print_table(["variant", "cap", "read/file pass 1", "read/file later passes", "s pass 1", "s/pass mean",
                 "time vs a)", "cgroup peak over baseline MiB"], table)
    print(f"checksums identical across variants: {len(sums) == 1}; time vs a): a' and b' against a', "
          "the others against a), same cap")
    if sweep:
        print()
        print_table(["io MiB", "threads", "s/pass (median of 3)", "MB/s", "read/file"],
                    [[s["io_mib"], s["threads"], f"{s['s']:.2f}", f"{size / s['s'] / 1e6:.0f}",
                      f"{s['read_bytes'] / size:.2f}"] for s in sweep])
    emit_json("uncached_read", {"file_bytes": size, "layer_bytes": args.layer_mib * MIB, "passes": args.passes,
                              "act_bytes": args.act_mib * MIB,
                              "io_bytes": args.io_mib * MIB, "threads": args.threads, "rows": rows, "sweep": sweep,
                              "checksums_identical": len(sums) == 1}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
