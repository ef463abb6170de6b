"""Many ranks on one host: what a mapped checkpoint costs against copies.

Generates one checkpoint (default 1 GiB, float32, a stack of column/row-parallel
linear pairs) in a temporary folder (deleted afterwards), then for each rank
count N runs ``torchrun --standalone --nproc-per-node N`` (gloo, CPU) four ways,
each rank loading the same file:

  copied    load_checkpoint(keep_mapping=False): every rank owns a copy
  mapped    load_checkpoint(keep_mapping=True): every rank maps the file
  tp-rows   tensor parallel, every weight split by rows (dim 0): each rank
            holds 1/N, as views of the mapping (zero bytes copied)
  tp-pair   Megatron's split: up by rows (views), down by columns (copied,
            reported as bytes_sliced_copied)

Every rank reads every byte it holds, then, while all ranks hold their
weights, each measures its RssAnon and Pss_Anon growth (/proc/self/status,
/proc/self/smaps_rollup) and the Pss/Rss of its mappings of the checkpoint
(/proc/self/smaps, restricted to the checkpoint's VMAs); rank 0 measures the
host's AnonPages growth (/proc/meminfo) and the checkpoint's pages in the page
cache (mincore). Weight PSS of a rank = Pss of its checkpoint mappings +
its Pss_Anon growth. The page cache is dropped (POSIX_FADV_DONTNEED) before
each run.

Targets (issue 11), 4 ranks mapped: host anonymous growth <= 2 % of the
checkpoint + 64 MiB per rank; total weight PSS <= 1.05 x checkpoint, where
copies give N x.

Run: python benchmarks/ranks_memory.py [--size-mib 1024] [--ranks 1,2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("copied", "mapped", "tp-rows", "tp-pair")
MIB = 1 << 20
D = 1024  # model width; the hidden width is chosen to reach the size asked for


# --- measuring, inside a rank -----------------------------------------------------------------


def _kib_field(path: str, name: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _smaps_of(path: str) -> tuple[int, int]:
    """(Rss, Pss) of this process's mappings of ``path``."""
    real = os.path.realpath(path)
    rss = pss = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] == real
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
            elif inside and head[0] == "Pss:":
                pss += int(head[1]) * 1024
    return rss, pss


def _page_cache_bytes(path: str) -> int:
    """Bytes of the file's tensors now in the page cache (mincore on a fresh mapping)."""
    from safetensors import safe_open

    from mapoffload import resident_bytes

    with safe_open(path, framework="pt") as f:
        tensors = [f.get_tensor(k) for k in f.keys()]
    return sum(resident_bytes(tensors))


def _model(layers: int, hidden: int, plan: dict[str, int] | None, tp: int):
    """The stack, with each weight at the shape of this rank's slice of it."""
    import torch

    def shape(key: str, full: tuple[int, int]) -> tuple[int, int]:
        dim = (plan or {}).get(key)
        if dim is None:
            return full
        out = list(full)
        out[dim] //= tp
        return tuple(out)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList()
            for i in range(layers):
                block = torch.nn.Module()
                for name, full in (("up", (hidden, D)), ("down", (D, hidden))):
                    out_f, in_f = shape(f"blocks.{i}.{name}.weight", full)
                    setattr(block, name, torch.nn.Linear(in_f, out_f, bias=False))
                self.blocks.append(block)

    return Stack()


def _shard_plan(mode: str, layers: int) -> dict[str, int] | None:
    if mode == "tp-rows":
        return {f"blocks.{i}.{k}.weight": 0 for i in range(layers) for k in ("up", "down")}
    if mode == "tp-pair":
        return {f"blocks.{i}.{k}.weight": d for i in range(layers) for k, d in (("up", 0), ("down", 1))}
    return None


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from mapoffload import empty_weights, load_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    host_anon0 = _kib_field("/proc/meminfo", "AnonPages") if rank == 0 else 0
    dist.barrier()
    rss_anon0 = _kib_field("/proc/self/status", "RssAnon")
    pss_anon0 = _kib_field("/proc/self/smaps_rollup", "Pss_Anon")

    plan = _shard_plan(args.mode, args.layers)
    with empty_weights():
        model = _model(args.layers, args.hidden, plan, world)
    report = load_checkpoint(model, args.path, keep_mapping=args.mode != "copied", shard_plan=plan,
                             rank=rank if plan else None, world_size=world if plan else None)
    held = sum(p.nbytes for p in model.parameters())
    checksum = sum(float(p.sum()) for p in model.parameters())  # every byte read
    dist.barrier()
    rss, pss = _smaps_of(args.path)
    row = {
        "rank": rank,
        "held_bytes": held,
        "rss_anon_growth": _kib_field("/proc/self/status", "RssAnon") - rss_anon0,
        "pss_anon_growth": _kib_field("/proc/self/smaps_rollup", "Pss_Anon") - pss_anon0,
        "ckpt_rss": rss,
        "ckpt_pss": pss,
        "bytes_mapped": report.bytes_mapped,
        "bytes_copied": report.bytes_copied,
        "bytes_sliced_mapped": report.bytes_sliced_mapped,
        "bytes_sliced_copied": report.bytes_sliced_copied,
        "checksum": checksum,
    }
    if rank == 0:
        row["host_anon_growth"] = _kib_field("/proc/meminfo", "AnonPages") - host_anon0
        row["page_cache"] = _page_cache_bytes(args.path)
    dist.barrier()  # every rank measured while every rank holds its weights
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


# --- the launcher ------------------------------------------------------------------------------


def generate(path: str, size: int, layers: int) -> int:
    """A checkpoint of about ``size`` bytes; returns the hidden width."""
    import torch
    from safetensors.torch import save_file

    hidden = max(64, size // (layers * 2 * D * 4) // 64 * 64)  # divisible by 1, 2, 4 ... 64 ranks
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        tensors[f"blocks.{i}.up.weight"] = torch.randn(hidden, D, generator=gen) * 0.02
        tensors[f"blocks.{i}.down.weight"] = torch.randn(D, hidden, generator=gen) * 0.02
    save_file(tensors, path)
    return hidden


def run(n: int, mode: str, path: str, layers: int, hidden: int, workdir: str) -> dict:
    from mapoffload import drop_page_cache

    drop_page_cache(path)
    out = os.path.join(workdir, f"{mode}-{n}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.abspath(__file__), "--child", "--mode", mode, "--path", path, "--out", out,
           "--layers", str(layers), "--hidden", str(hidden)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {n} ranks, {mode}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    with open(out) as f:
        rows = json.load(f)
    size = os.path.getsize(path)
    weight_pss = sum(r["ckpt_pss"] + max(0, r["pss_anon_growth"]) for r in rows)
    result = {
        "ranks": n,
        "mode": mode,
        "checkpoint_bytes": size,
        "host_anon_growth": rows[0]["host_anon_growth"],
        "sum_rss_anon_growth": sum(r["rss_anon_growth"] for r in rows),
        "sum_weight_pss": weight_pss,
        "weight_pss_x_checkpoint": weight_pss / size,
        "page_cache": rows[0]["page_cache"],
        "held_per_rank": rows[0]["held_bytes"],
        "sliced_mapped_per_rank": rows[0]["bytes_sliced_mapped"],
        "sliced_copied_per_rank": rows[0]["bytes_sliced_copied"],
        "per_rank": rows,
    }
    if mode == "mapped":
        limit = 0.02 * size + 64 * MIB * n
        result["target_anon_ok"] = result["sum_rss_anon_growth"] <= limit
        result["target_pss_ok"] = weight_pss <= 1.05 * size
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (a disk, not tmpfs)")
    ap.add_argument("--json", default=None)
    # inside a rank
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    from _common import emit_json, print_table

    ranks = [int(x) for x in args.ranks.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {MODES}")
    results = []
    with tempfile.TemporaryDirectory(prefix="mapoffload-ranks-", dir=args.dir) as work:
        path = os.path.join(work, "stack.safetensors")
        hidden = generate(path, args.size_mib * MIB, args.layers)
        for n in ranks:
            for mode in modes:
                results.append(run(n, mode, path, args.layers, hidden, work))
    mib = lambda b: f"{b / MIB:.1f}"  # noqa: E731
    print_table(
        ["ranks", "mode", "held/rank MiB", "host AnonPages Δ MiB", "Σ RssAnon Δ MiB", "Σ weight PSS MiB",
         "PSS × ckpt", "page cache MiB", "sliced mapped/rank MiB", "sliced copied/rank MiB"],
        [[r["ranks"], r["mode"], mib(r["held_per_rank"]), mib(r["host_anon_growth"]), mib(r["sum_rss_anon_growth"]),
          mib(r["sum_weight_pss"]), f"{r['weight_pss_x_checkpoint']:.2f}", mib(r["page_cache"]),
          mib(r["sliced_mapped_per_rank"]), mib(r["sliced_copied_per_rank"])] for r in results],
    )
    emit_json("ranks_memory", {"size_mib": args.size_mib, "layers": args.layers, "hidden": hidden,
                               "results": results}, args.json)


if __name__ == "__main__":
    main()
