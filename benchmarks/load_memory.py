"""Anonymous memory and time to get a loaded model, four ways.

Generates a checkpoint (default 1 GiB) and, each in a fresh process, builds a
model and loads it:

  a) copy       model built normally, load_state_dict of the checkpoint
  b) by hand    model on meta, safetensors load_file + load_state_dict(assign=True)
  c) mapped     empty_weights() + load_checkpoint(keep_mapping=True)
  d) copied     empty_weights() + load_checkpoint(keep_mapping=False)

Peak RssAnon growth is sampled every millisecond from /proc/self/status by a
thread; seconds cover build + load. Target for (c): growth <= 1 % of the
checkpoint + 16 MiB.

Run: python benchmarks/load_memory.py [--gib 1] [--layers 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

VARIANTS = {
    "a": "load_state_dict (copy)",
    "b": "load_file + assign=True",
    "c": "load_checkpoint mapped",
    "d": "load_checkpoint copied",
}


def child(variant: str, path: str, layers: int, rows: int, cols: int) -> None:
    import torch
    from safetensors.torch import load_file
    from torch import nn

    from mapoffload import empty_weights, load_checkpoint
    from mapoffload.memory.budget import rss_anon_bytes as rss_anon

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(cols, rows, bias=False) for _ in range(layers))

    base = rss_anon()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    if variant == "a":
        model = Stack()
        model.load_state_dict(load_file(path))
    elif variant == "b":
        with torch.device("meta"):
            model = Stack()
        model.load_state_dict(load_file(path), assign=True)
    else:
        with empty_weights():
            model = Stack()
        load_checkpoint(model, path, keep_mapping=(variant == "c"))
    seconds = time.perf_counter() - t0
    checksum = sum(float(layer.weight[0, 0]) for layer in model.layers)
    stop.set()
    th.join()
    peak[0] = max(peak[0], rss_anon())
    print(json.dumps({"variant": variant, "peak_anon_growth": peak[0] - base, "seconds": seconds,
                      "checksum": checksum}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        v, path, layers, rows, cols = args.child
        child(v, path, int(layers), int(rows), int(cols))
        return 0

    import torch
    from safetensors.torch import save_file

    from _common import emit_json, machine, print_table

    cols = 4096
    rows = max(1, int(args.gib * (1 << 30) / (args.layers * cols * 4)))
    print(f"machine: {machine()}")
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("MAPOFFLOAD_BENCH_DIR")) as tmp:
        path = os.path.join(tmp, "stack.safetensors")
        save_file({f"layers.{i}.weight": torch.full((rows, cols), float(i)) for i in range(args.layers)}, path)
        size = os.path.getsize(path)
        print(f"checkpoint: {size / 2**30:.2f} GiB, {args.layers} tensors of {rows}x{cols} fp32")
        for v in VARIANTS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", v, path, str(args.layers), str(rows), str(cols)],
                capture_output=True, text=True, check=True,
            )
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    expected = sum(float(i) for i in range(args.layers))
    rows_out = []
    for r in results:
        assert r["checksum"] == expected, r
        rows_out.append([
            f"{r['variant']}) {VARIANTS[r['variant']]}", f"{r['peak_anon_growth'] / 2**20:.1f}",
            f"{100 * r['peak_anon_growth'] / size:.2f}", f"{r['seconds']:.3f}",
        ])
    print()
    print_table(["variant", "peak RssAnon growth MiB", "% of checkpoint", "seconds"], rows_out)
    c = next(r for r in results if r["variant"] == "c")
    limit = 0.01 * size + 16 * 2**20
    print(f"\ntarget (c) <= 1 % + 16 MiB = {limit / 2**20:.1f} MiB: {c['peak_anon_growth'] / 2**20:.1f} MiB "
          f"({'met' if c['peak_anon_growth'] <= limit else 'MISSED'})")
    emit_json("load_memory", {"checkpoint_bytes": size, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
