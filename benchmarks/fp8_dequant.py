"""How fast one fine-grained FP8 weight is dequantized on the CPU (issue 17).

For a 3584 x 1024 and a 1024 x 1024 projection (float8_e4m3fn codes, float32
``weight_scale_inv`` per [128, 128] block, into bfloat16), side by side in one
run, each into an output buffer reused across calls (a working buffer kept
across forwards):

  a) torch      mapoffload's torch path: transformers' arithmetic
                (codes.to(float32) * scale per block).to(bf16), in bands
  b) native     dequantize_fp8 as it runs now: _core.dequantize_fp8 on
                torch.get_num_threads() threads (SIMD lookup where the CPU has it)
  c) native-1t  the same on one thread
  d) portable   the native kernel's portable loop (simd=False), same threads as b
  e) bf16 copy  copying the bf16 weight (what reading it costs a bf16 model)

"hot": the same weight again and again (its codes stay in cache); "cold":
round-robin over --cold-mib MiB of distinct weights (codes and scales from
DRAM, as in a forward, where each weight is read once), into the same output
buffer. Medians of --repeat runs after a warm-up, in ns per parameter; ratios
against a) in the same run. The results are checked equal to a) bit for bit
first.

Run: nice python benchmarks/fp8_dequant.py [--repeat 9] [--cold-mib 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch

from _common import emit_json, machine, print_table, timeit
from mapoffload.loading import fp8
from mapoffload._native import _core

SHAPES = ((3584, 1024), (1024, 1024))
BLOCK = 128


def weight(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random projection quantized as fine-grained FP8 checkpoints store it."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    return fp8.quantize_fp8(w, (BLOCK, BLOCK))


def contenders(weights: list, out: torch.Tensor, threads: int) -> dict:
    """name -> fn(codes, scale) writing ``out`` (the bf16 copy reads a bf16 weight of the same shape instead)."""
    rows, cols = out.shape
    bf16 = [torch.empty_like(out).fill_(1.0) for _ in weights]  # written: real pages, not the zero page
    by_codes = {c.data_ptr(): b for (c, _), b in zip(weights, bf16)}
    nan = fp8._native_nan_rules()[torch.bfloat16]

    def torch_path(codes, scale):
        with mock.patch.object(fp8, "_dequantize_native", lambda *a: False):
            fp8.dequantize_fp8(codes, scale, dtype=torch.bfloat16, out=out)

    def kernel(n: int, simd: bool):
        def run(codes, scale):
            _core.dequantize_fp8(codes.data_ptr(), scale.data_ptr(), out.data_ptr(), lead=1, rows=rows, cols=cols,
                                 scale_lead=1, srows=scale.shape[0], scols=scale.shape[1], fp8_format="e4m3fn",
                                 out_dtype="bfloat16", bf16_nan=nan, threads=n, simd=simd)
        return run

    return {
        "torch": torch_path,
        "native": lambda codes, scale: fp8.dequantize_fp8(codes, scale, dtype=torch.bfloat16, out=out),
        "native-1t": kernel(1, True),
        "portable": kernel(threads, False),
        "bf16 copy": lambda codes, scale: out.copy_(by_codes[codes.data_ptr()]),
    }


def cold(fn, weights: list, repeat: int) -> float:
    """Median seconds of one call, round-robin over the weights (each cold when its turn comes)."""
    fn(*weights[0])
    times = []
    for _ in range(max(1, repeat // len(weights)) + 1):
        for codes, scale in weights:
            t0 = time.perf_counter()
            fn(codes, scale)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--cold-mib", type=int, default=256, help="MiB of distinct weights (codes + bf16) for 'cold'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    threads = torch.get_num_threads()
    print(f"{machine()}; torch {torch.__version__}, {threads} threads; SIMD: {_core.fp8_simd() or 'none'}; "
          f"load average {os.getloadavg()[0]:.2f}")
    rows_out, results = [], []
    for shape in SHAPES:
        n = shape[0] * shape[1]
        count = max(2, (args.cold_mib << 20) // (3 * n))
        weights = [weight(shape, seed) for seed in range(count)]
        out = torch.empty(shape, dtype=torch.bfloat16)
        runs = contenders(weights, out, threads)
        runs["torch"](*weights[0])
        want = out.clone()
        for name in ("native", "native-1t", "portable"):
            out.zero_()
            runs[name](*weights[0])
            if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                raise SystemExit(f"{name} differs from the torch path on {shape}")
        hot = {name: timeit(lambda fn=fn: fn(*weights[0]), repeat=args.repeat, warmup=2) for name, fn in runs.items()}
        cool = {name: cold(fn, weights, args.repeat) for name, fn in runs.items()}
        for name in runs:
            h, c = hot[name], cool[name]
            rows_out.append([f"{shape[0]}x{shape[1]}", name, f"{h / n * 1e9:.3f}", f"{hot['torch'] / h:.1f}x",
                             f"{c / n * 1e9:.3f}", f"{cool['torch'] / c:.1f}x"])
            results.append({"shape": list(shape), "contender": name, "hot_seconds": h, "hot_ns_per_param": h / n * 1e9,
                            "hot_speedup_vs_torch": hot["torch"] / h, "cold_seconds": c,
                            "cold_ns_per_param": c / n * 1e9, "cold_speedup_vs_torch": cool["torch"] / c,
                            "cold_weights": count})
        del weights
    print_table(["weight", "contender", "hot ns/param", "hot vs torch", "cold ns/param", "cold vs torch"], rows_out)
    emit_json("fp8_dequant", {"threads": threads, "simd": _core.fp8_simd(), "block": [BLOCK, BLOCK],
                              "out_dtype": "bfloat16", "repeat": args.repeat, "cold_mib": args.cold_mib,
                              "load_average": os.getloadavg()[0], "results": results}, args.json)


if __name__ == "__main__":
    main()
