"""Copy bandwidth from host memory into device (or CPU) buffers.

Sources: pinned host memory (CUDA only), pageable anonymous memory, a mapped
safetensors checkpoint hot in page cache, and the same cold (its pages dropped
with POSIX_FADV_DONTNEED before every repetition). Modes: the copier's
``direct`` and ``staged``. The limit, measured in the same run: pinned H2D
(``Tensor.copy_(non_blocking=True)``) on CUDA, single-threaded libc memcpy
anonymous -> anonymous on CPU.

Printed: GB/s, the ratio to the limit, and the bytes of the mapping that turned
anonymous (copy-on-write broken), as a table and JSON.

Run: python benchmarks/prefetch_bw.py [--device cpu|cuda] [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from safetensors.torch import load_file, save_file

from _common import emit_json, machine, print_table
from mapoffload import Copier, cow_report, drop_page_cache


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, repeat: int, before=None) -> float:
    """Median seconds of fn(arg), arg = before() (untimed) when given."""
    times = []
    for _ in range(repeat):
        arg = before() if before else None
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=int, default=256, help="bytes copied per repetition")
    ap.add_argument("--tensor-mib", type=int, default=16, help="size of each source tensor")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--staging-mib", type=int, default=None)
    ap.add_argument("--slots", type=int, default=None)
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    n_tensors = max(1, args.mib // args.tensor_mib)
    numel = args.tensor_mib * (1 << 20) // 4
    total = n_tensors * numel * 4
    print(f"machine: {machine()}")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"{total / 2**20:.0f} MiB per repetition in {n_tensors} tensors, median of {args.repeat}")

    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("MAPOFFLOAD_BENCH_DIR")) as tmp:
        path = os.path.join(tmp, "bw.safetensors")
        save_file({f"t{i}": torch.full((numel,), float(i)) for i in range(n_tensors)}, path)
        mapped = list(load_file(path).values())
        anon = [torch.full((numel,), float(i)) for i in range(n_tensors)]
        dsts = [torch.empty(numel, device=device) for _ in range(n_tensors)]

        # The limit.
        if device.type == "cuda":
            pinned = [a.pin_memory() for a in anon]

            def limit():
                for d, s in zip(dsts, pinned):
                    d.copy_(s, non_blocking=True)
                sync(device)

            limit_name = "pinned H2D (copy_)"
        else:
            memmove = ctypes.memmove

            def limit():
                for d, s in zip(dsts, anon):
                    memmove(d.data_ptr(), s.data_ptr(), s.nbytes)

            limit_name = "memcpy anon->anon"
        t_limit = measure(lambda _: limit(), args.repeat)
        gbps_limit = total / t_limit / 1e9
        results.append({"source": "anonymous", "mode": limit_name, "gbps": gbps_limit, "ratio": 1.0,
                        "cow_bytes": 0})
        if device.type == "cuda":
            del pinned

        def run(copier, srcs):
            copier.copy(dsts, srcs).wait()
            sync(device)

        def cold_sources():
            # Pages mapped into this process are not dropped by fadvise: unmap
            # (drop every view), drop the file's pages, map it again.
            mapped.clear()
            drop_page_cache(path)
            mapped.extend(load_file(path).values())
            return mapped

        for mode in ("direct", "staged"):
            copier = Copier(device, mode, threads=args.threads, staging_bytes=args.staging_mib and args.staging_mib << 20,
                            slots=args.slots)
            with copier:
                for source, before in (
                    ("anonymous", lambda: anon),
                    ("mapped hot", lambda: mapped),
                    ("mapped cold", cold_sources),
                ):
                    if source == "mapped hot":
                        run(copier, mapped)  # warm the page cache
                    # Every mapping is new or was checked clean: anonymous bytes
                    # inside it after the copies were made by them.
                    t = measure(lambda srcs: run(copier, srcs), args.repeat, before)
                    srcs = before()
                    run(copier, srcs)
                    cow = cow_report(mapped).anonymous_bytes if source != "anonymous" else 0
                    ok = all(float(d[0]) == float(s[0]) and float(d[-1]) == float(s[-1]) for d, s in zip(dsts, srcs))
                    assert ok, f"{mode} {source}: wrong bytes"
                    gbps = total / t / 1e9
                    results.append({"source": source, "mode": mode, "gbps": gbps, "ratio": gbps / gbps_limit,
                                    "cow_bytes": cow})

    print()
    print_table(
        ["source", "mode", "GB/s", "x limit", "bytes turned anonymous"],
        [[r["source"], r["mode"], f"{r['gbps']:.2f}", f"{r['ratio']:.2f}", r["cow_bytes"]] for r in results],
    )
    by = {(r["source"], r["mode"]): r for r in results}
    hot = by[("mapped hot", "staged")]["ratio"]
    cold = by[("mapped cold", "staged")]["gbps"] / by[("mapped cold", "direct")]["gbps"]
    target_hot = 0.9 if device.type == "cuda" else 0.8
    print(
        f"\ntargets: staged hot >= {target_hot}x limit: {hot:.2f}x; cold staged >= 1.5x cold direct: {cold:.2f}x; "
        f"staged turned anonymous: {sum(r['cow_bytes'] for r in results if r['mode'] == 'staged')} bytes"
    )
    emit_json("prefetch_bw", {"device": str(device), "bytes": total, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
