"""Per-step time of a layer stack under the layerwise offload manager.

A stack of MLP blocks (sized by arguments) is saved as safetensors and loaded
mapped. Modes side by side, in one run:

  resident         every weight on the device, plain forward (the limit)
  pinned           consolidated pinned store (pageable on CPU), staged copies on a copy stream
  mapped+direct    mapped store, direct copies on the compute stream (the seed's path)
  mapped+staged    mapped store, staged copies on a copy stream (ours)

Printed: step seconds (median), ratio to resident and to pinned, peak device
bytes held by the manager, host RssAnon growth, as a table and JSON.

Run: python benchmarks/offload_step.py [--device cpu|cuda] [--layers 8] [--width 1024]
     [--dtype float32] [--batch 512] [--steps 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from safetensors.torch import save_file
from torch import nn

from _common import emit_json, machine, print_table
from mapoffload import Copier, LayerwiseOffloadManager, empty_weights, load_checkpoint
from mapoffload.memory.budget import rss_anon_bytes as rss_anon


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model: nn.Module, x: torch.Tensor, steps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        out = model(x)  # warm-up (page cache, allocator, kernels)
        sync(device)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(x)
            sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch", type=int, default=512, help="tokens per step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ref = Stack(args.layers, args.width).to(dtype)
    weight_bytes = sum(p.nbytes for p in ref.parameters())
    x = torch.randn(args.batch, args.width, dtype=dtype, device=device)
    print(f"machine: {machine()}")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"{args.layers} layers x width {args.width} {args.dtype}: {weight_bytes / 2**20:.0f} MiB of weights, "
          f"{args.batch} tokens a step, median of {args.steps} steps")

    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("MAPOFFLOAD_BENCH_DIR")) as tmp:
        path = os.path.join(tmp, "stack.safetensors")
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)

        resident = Stack(args.layers, args.width).to(dtype)
        resident.load_state_dict(ref.state_dict())
        resident.to(device)
        t_res, expected = time_steps(resident, x, args.steps, device)
        results.append({"mode": "resident", "step_s": t_res, "peak_device_bytes": weight_bytes, "host_anon_growth": 0})
        del resident
        gc.collect()

        # mapped+direct: the seed runtime's path (a direct-mode copier copies on the compute stream).
        modes = [
            ("pinned", "pinned" if device.type == "cuda" else "pageable", "staged"),
            ("mapped+direct", "mapped", "direct"),
            ("mapped+staged", "mapped", "staged"),
        ]
        for name, store, copy_mode in modes:
            anon0 = rss_anon()
            with empty_weights():
                model = Stack(args.layers, args.width).to(dtype)
            load_checkpoint(model, path, keep_mapping=True)
            copier = Copier(device, copy_mode)
            mgr = LayerwiseOffloadManager(model, "blocks", device=device, prefetch_layers=args.prefetch,
                                          host_store=store, copier=copier,
                                          # On the CPU: the device pipeline's twin, the copies are what it measures.
                                          cpu_twin=device.type == "cpu")
            mgr.register_forward_hooks()
            t, out = time_steps(model, x, args.steps, device)
            if not torch.allclose(out.float(), expected.float(), rtol=1e-3, atol=1e-3):
                raise SystemExit(f"{name}: output differs from the resident model")
            results.append({"mode": name, "step_s": t, "peak_device_bytes": mgr.peak_device_bytes,
                            "host_anon_growth": rss_anon() - anon0, "mapped_bytes": mgr.mapped_bytes,
                            "pinned_bytes": mgr.pinned_bytes, "pageable_bytes": mgr.pageable_bytes})
            mgr.close()
            copier.close()
            del mgr, model, copier
            gc.collect()

    t_pinned = next(r["step_s"] for r in results if r["mode"] == "pinned")
    rows = []
    for r in results:
        r["x_resident"] = r["step_s"] / t_res
        r["x_pinned"] = r["step_s"] / t_pinned
        rows.append([r["mode"], f"{r['step_s'] * 1e3:.1f}", f"{r['x_resident']:.2f}", f"{r['x_pinned']:.2f}",
                     f"{r['peak_device_bytes'] / 2**20:.1f}", f"{r['host_anon_growth'] / 2**20:.1f}"])
    print()
    if device.type == "cpu":
        print("(on CPU the manager's device buffers and the copier's staging slots are host anonymous memory too)")
    print_table(["mode", "step ms", "x resident", "x pinned", "peak device MiB", "host anon growth MiB"], rows)
    by = {r["mode"]: r for r in results}
    if device.type == "cuda":
        print(f"\ntargets: mapped+staged <= 1.15x pinned: {by['mapped+staged']['x_pinned']:.2f}x; "
              f"mapped+direct / mapped+staged: {by['mapped+direct']['step_s'] / by['mapped+staged']['step_s']:.2f}x")
    else:
        print(f"\ntarget: manager overhead <= 10 % over a plain forward (hot weights): "
              f"mapped+staged {100 * (by['mapped+staged']['x_resident'] - 1):.1f} %")
    emit_json("offload_step", {"device": str(device), "weight_bytes": weight_bytes, "args": vars(args),
                               "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
