"""Decode-sized GEMMs on vLLM's CPU backend: what the mapoffload load format computes with, per layout.

For each linear shape of the ``vllm_serve.py`` model (hidden 2048, intermediate 5632; q/k/v/o, gate,
up, down) and ``--m`` rows (the decode batch): weight bytes read per second by

  F.linear mapped   torch.nn.functional.linear over the weight as a safetensors file maps it
                    (oneDNN re-blocking the plain rows each call: ``pack=false``, the default)
  F.linear anon     the same over an anonymous copy (the mapping's own cost, if any)
  oneDNN packed     vLLM's ``create_onednn_mm`` handler (its own packed copy: ``pack=true``, vLLM's loader)
  vnni mapped       vLLM's small-GEMM kernel over the weight packed for it (``vnni=true``), the packed
                    bytes read from a mapped file as the conversion folder holds them

and whether each equals oneDNN packed's output bit for bit. Needs vLLM's CPU build; ``vnni`` needs
AVX-512 BF16 (the row says so where the kernel does not run). Weights of ~16-23 MB partly fit the
last-level cache: compare the columns, not the GB/s with the memory's bandwidth.

Run: python benchmarks/vllm_gemm.py [--m 4] [--reps 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"q/k/v/o": (2048, 2048), "gate, up": (5632, 2048), "down": (2048, 5632), "qkv": (6144, 2048)}


def _rate(fn, nbytes: int, reps: int) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.perf_counter() - t) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4, help="rows of the activation (requests decoded at once)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    from _common import emit_json, machine, print_table
    from mapoffload.loading.read import read_file
    from mapoffload.vllm._compute import VNNI, _vnni_linear, mapped_layout

    current_platform.import_kernels()
    vnni = mapped_layout() == VNNI
    torch.manual_seed(0)
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}; M = {args.m}; "
          f"vnni kernel: {'runs' if vnni else 'does not run here'}")
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            tensors = {"w": w}
            if vnni:
                tensors["p"] = torch.ops._C.convert_weight_packed(w)
            path = os.path.join(tmp, f"{name.replace('/', '')}.safetensors".replace(" ", "").replace(",", ""))
            save_file(tensors, path)
            mapped = read_file(path)  # views of the file's mapping
            x = torch.randn(args.m, k).to(torch.bfloat16)
            handler = ops.create_onednn_mm(w.t(), 32)
            ref = ops.onednn_mm(handler, x, None)
            r = {"shape": name, "n": n, "k": k,
                 "f_linear_mapped": _rate(lambda: F.linear(x, mapped["w"]), w.nbytes, args.reps),
                 "f_linear_anon": _rate(lambda: F.linear(x, w), w.nbytes, args.reps),
                 "onednn_packed": _rate(lambda: ops.onednn_mm(handler, x, None), w.nbytes, args.reps),
                 "plain_equal": torch.equal(F.linear(x, mapped["w"]), ref)}
            if vnni:
                r["vnni_mapped"] = _rate(lambda: _vnni_linear(x, mapped["p"], None), w.nbytes, args.reps)
                out = _vnni_linear(x, mapped["p"], None)
                r["vnni_equal"] = torch.equal(out, ref)
                r["vnni_differing"] = int((out != ref).sum())
            results.append(r)
            rows.append([name, f"{n}x{k}", f"{r['f_linear_mapped']:.1f}", f"{r['f_linear_anon']:.1f}",
                         f"{r['onednn_packed']:.1f}", f"{r['vnni_mapped']:.1f}" if vnni else "-",
                         f"{r['vnni_mapped'] / r['onednn_packed']:.2f}x" if vnni else "-",
                         f"{r['f_linear_mapped'] / r['onednn_packed']:.2f}x", r["plain_equal"],
                         f"{r['vnni_differing']} of {n * args.m}" if vnni else "-"])
    print_table(["shape", "N x K", "F.linear mapped GB/s", "F.linear anon", "oneDNN packed", "vnni mapped",
                 "vnni vs oneDNN", "F.linear mapped vs oneDNN", "plain == oneDNN", "vnni outputs != oneDNN"], rows)
    emit_json("vllm_gemm", {"m": args.m, "reps": args.reps, "vnni": vnni, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
