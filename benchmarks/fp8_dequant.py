"""How fast one fine-grained FP8 weight is dequantized on the CPU (issue 17).

For a 3584 x 1024 and a 1024 x 1024 projection (float8_e4m3fn codes, float32
``weight_scale_inv`` per [128, 128] block, into bfloat16), side by side in one
run, each into an output buffer reused across calls (as the parametrization's
working buffer is):

  a) torch      mapoffload's torch path: transformers' arithmetic
                (codes.to(float32) * scale per block).to(bf16), in bands
  b) native     dequantize_fp8 as it runs now: _core.dequantize_fp8 on
                torch.get_num_threads() threads (SIMD lookup where the CPU has it)
  c) native-1t  the same on one thread
  d) portable   the native kernel's portable loop (simd=False), same threads as b
  e) bf16 copy  copying the bf16 weight (what reading it costs a bf16 model)

Median of --repeat runs after a warm-up, in ns per parameter; ratios against
a) in the same run. The results are checked equal to a) bit for bit first.

Run: nice python benchmarks/fp8_dequant.py [--repeat 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch

from _common import emit_json, machine, print_table, timeit
from mapoffload import fp8
from mapoffload._native import _core

SHAPES = ((3584, 1024), (1024, 1024))
BLOCK = 128


def weight(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    return fp8.quantize_fp8(w, (BLOCK, BLOCK))


def contenders(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, threads: int) -> dict:
    rows, cols = codes.shape
    bf16 = out.clone()
    copy_dst = torch.empty_like(bf16)

    def torch_path():
        with mock.patch.object(fp8, "_dequantize_native", lambda *a: False):
            fp8.dequantize_fp8(codes, scale, dtype=torch.bfloat16, out=out)

    def kernel(n: int, simd: bool):
        def run():
            _core.dequantize_fp8(codes.data_ptr(), scale.data_ptr(), out.data_ptr(), lead=1, rows=rows, cols=cols,
                                 scale_lead=1, srows=scale.shape[0], scols=scale.shape[1], fp8_format="e4m3fn",
                                 out_dtype="bfloat16", bf16_nan=fp8._native_nan_rules()[torch.bfloat16],
                                 threads=n, simd=simd)
        return run

    return {
        "torch": torch_path,
        "native": lambda: fp8.dequantize_fp8(codes, scale, dtype=torch.bfloat16, out=out),
        "native-1t": kernel(1, True),
        "portable": kernel(threads, False),
        "bf16 copy": lambda: copy_dst.copy_(bf16),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    threads = torch.get_num_threads()
    print(f"{machine()}; torch {torch.__version__}, {threads} threads; SIMD: {_core.fp8_simd() or 'none'}")
    rows_out, results = [], []
    for shape in SHAPES:
        codes, scale = weight(shape)
        out = torch.empty(shape, dtype=torch.bfloat16)
        runs = contenders(codes, scale, out, threads)
        runs["torch"]()
        want = out.clone()
        for name in ("native", "native-1t", "portable"):
            out.zero_()
            runs[name]()
            if not torch.equal(out.view(torch.int16), want.view(torch.int16)):
                raise SystemExit(f"{name} differs from the torch path on {shape}")
        n = codes.numel()
        secs = {name: timeit(fn, repeat=args.repeat, warmup=2) for name, fn in runs.items()}
        for name, s in secs.items():
            ns = s / n * 1e9
            ratio = secs["torch"] / s
            rows_out.append([f"{shape[0]}x{shape[1]}", name, f"{s * 1e3:.3f}", f"{ns:.3f}",
                             "1.00x" if name == "torch" else f"{ratio:.1f}x faster"])
            results.append({"shape": list(shape), "contender": name, "seconds": s, "ns_per_param": ns,
                            "speedup_vs_torch": ratio})
    print_table(["weight", "contender", "ms (median)", "ns / param", "vs torch"], rows_out)
    emit_json("fp8_dequant", {"threads": threads, "simd": _core.fp8_simd(), "block": [BLOCK, BLOCK],
                              "out_dtype": "bfloat16", "repeat": args.repeat, "results": results}, args.json)


if __name__ == "__main__":
    main()
