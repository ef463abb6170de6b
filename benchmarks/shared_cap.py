"""Two processes under one memory cap (issue 18): local ranks holding
tensor-parallel halves, and replicas of one model, each pair in one cgroup at
base + 50 % of the bytes the pair maps - with the page-cache coordinator's
peer records (the two agree) and without (each plans alone, its own
MAPOFFLOAD_PEERS_DIR: the behaviour before issue 18), in the same run.

The model is a stack of --layers square fp32 Linear layers (--width); its
checkpoint is written once to --dir (a disk, not tmpfs). Ranks: rank r maps
a file of its own holding its half of every layer (rows r*width/2..), so the
pair maps the whole model once. Replicas: both map the one whole file.

Each child loads with keep_mapping=True, starts a LayerwiseOffloadManager on
the CPU and waits; the parent then sets the cap (the cgroup's usage with both
children idle, less the weights' pages cached by then, plus 50 % of the
unique bytes the pair maps), and both run
--forwards forwards at once. Per forward each child records its read_bytes
(/proc/self/io) and, at every layer, the resident bytes of each of its layers
(mincore): the residency trace.

Columns: pair, mode (coordinated / alone), reads per forward of the pair
(summed over both children, mean of forwards 2..N), the bound, reads / bound,
peak resident layer bytes of the pair over the budget, forward seconds
(slowest child, mean of 2..N), and what each child's plan said. The bound:
ranks - the pair's unique bytes less the budget (the floor when the budget
holds a fixed set); replicas - twice (checkpoint - budget): each replica
reads the streamed part, the cached part is shared. Target (issue 18): reads
per forward <= 1.15 x the bound, coordinated.

--figure writes the residency trace (resident layer bytes of the pair at
each layer of the forwards, against the budget) as a PNG (matplotlib: pip
install ".[bench]").

Run (root, cgroups): python benchmarks/shared_cap.py [--layers 16] [--width 2048]
     [--forwards 4] [--dir /var/tmp] [--json out.json] [--figure trace.png]
     [--reads auto|mapping|uncached] [--pairs ranks,replicas] [--modes coordinated,alone]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))  # cgroups.py

MIB = 1 << 20
NO_LIMIT = 1 << 62

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint, resident_bytes
    from mapoffload.pagecache.coordinator import coordinator

    path, layers, rows, cols, go, out, forwards, read_mode = sys.argv[1:9]
    layers, rows, cols, forwards = int(layers), int(rows), int(cols), int(forwards)
    torch.set_num_threads(1)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(cols, rows, bias=False) for _ in range(layers))
        def forward(self, x):
            for b in self.blocks:
                y = torch.tanh(b(x))
                x = y if rows == cols else torch.cat([y, y], dim=1)  # a rank's half, tiled back to the width
            return x

    def read_bytes():
        for line in open("/proc/self/io"):
            if line.startswith("read_bytes"):
                return int(line.split()[1])

    with empty_weights():
        model = Stack()
    load_checkpoint(model, path, keep_mapping=True)
    mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", reads=read_mode)
    hosts = [t for _, t in sorted(mgr.iter_cpu_weights(), key=lambda kv: int(kv[0].split(".")[1]))]
    trace = []
    probes = [b.register_forward_pre_hook(lambda m, a, i=i: trace.append(
        (i, [sum(resident_bytes([h])) for h in hosts])), prepend=False) for i, b in enumerate(model.blocks)]
    mgr.register_forward_hooks()
    open(go + ".ready." + str(os.getpid()), "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    x = torch.ones(1, cols)
    reads, secs = [], []
    with torch.no_grad():
        for _ in range(forwards):
            r0, t0 = read_bytes(), time.perf_counter()
            model(x)
            reads.append(read_bytes() - r0)
            secs.append(time.perf_counter() - t0)
    c = coordinator()
    json.dump({"pid": os.getpid(), "reads": reads, "secs": secs, "trace": trace, "plan": mgr.residency.describe(),
               "budget": mgr.residency.budget, "ranks": c.ranks, "replicas": c.replicas,
               "page_cache": str(c.budget), "read_mode": [mgr.parts.member.reads_mode, mgr.parts.member.reads_why]}, open(out, "w"))
    mgr.close()
    """
)


def write_checkpoints(folder: str, layers: int, width: int) -> dict:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    whole = {f"blocks.{i}.weight": torch.randn(width, width, generator=g) * 0.02 for i in range(layers)}
    paths = {"whole": os.path.join(folder, "whole.safetensors")}
    save_file(whole, paths["whole"])
    for r in range(2):
        half = {k: v[r * width // 2:(r + 1) * width // 2].contiguous() for k, v in whole.items()}
        paths[f"rank{r}"] = os.path.join(folder, f"rank{r}.safetensors")
        save_file(half, paths[f"rank{r}"])
    os.sync()
    return paths


def run_pair(pair: str, coordinated: bool, paths: dict, args, work: str) -> dict:
    from capped_forward import _cg_set_cap, _cg_usage
    from cgroups import memory_cgroup

    from mapoffload import drop_page_cache

    for p in paths.values():
        drop_page_cache(p)
    tag = f"{pair}-{'coord' if coordinated else 'alone'}"
    run = os.path.join(work, tag)
    os.makedirs(run)
    go = os.path.join(run, "go")
    if pair == "ranks":
        files, rows = [paths["rank0"], paths["rank1"]], args.width // 2
        unique = 2 * os.path.getsize(paths["rank0"])
    else:
        files, rows = [paths["whole"], paths["whole"]], args.width
        unique = os.path.getsize(paths["whole"])
    with memory_cgroup(NO_LIMIT) as cg:
        procs = []
        for k, f in enumerate(files):
            env = dict(os.environ)
            env.pop("MAPOFFLOAD_HOST_AVAILABLE_GIB", None)
            env["MAPOFFLOAD_PEERS_DIR"] = os.path.join(run, "peers" if coordinated else f"peers{k}")
            script = f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$@"'
            procs.append(subprocess.Popen(
                ["sh", "-c", script, sys.executable, CHILD, f, str(args.layers), str(rows), str(args.width), go,
                 os.path.join(run, f"out{k}.json"), str(args.forwards), args.read_mode], env=env, cwd=run,
                stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + args.timeout
        while sum(n.startswith("go.ready.") for n in os.listdir(run)) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                return {"pair": pair, "coordinated": coordinated, "error": [p.stderr.read()[-1500:] for p in procs]}
            time.sleep(0.05)
        # The usage besides the weights' own cached pages (loading may have read
        # some): the cap leaves the weights half of what the pair maps.
        from mapoffload import _core

        weights_cached = sum(_core.file_resident_bytes(f)[0] for f in set(files))
        base = _cg_usage(cg) - weights_cached
        cap = base + unique // 2
        _cg_set_cap(cg, cap)
        budget = cap - base
        open(go, "w").close()
        codes = [p.wait(timeout=args.timeout) for p in procs]
        errors = [p.stderr.read()[-1500:] for p in procs]
    if any(codes):
        return {"pair": pair, "coordinated": coordinated, "error": errors, "codes": codes}
    outs = [json.load(open(os.path.join(run, f"out{k}.json"))) for k in range(2)]
    per_forward = [sum(o["reads"][f] for o in outs) for f in range(args.forwards)]
    warm = per_forward[1:] or per_forward
    bound = unique - budget if pair == "ranks" else 2 * (unique - budget)
    # The pair's resident layer bytes at each layer step (replicas: the same pages, counted once).
    steps = min(len(o["trace"]) for o in outs)
    if pair == "ranks":
        trace = [sum(outs[0]["trace"][s][1]) + sum(outs[1]["trace"][s][1]) for s in range(steps)]
    else:
        trace = [max(sum(outs[0]["trace"][s][1]), sum(outs[1]["trace"][s][1])) for s in range(steps)]
    return {
        "pair": pair, "coordinated": coordinated, "unique_bytes": unique, "baseline": base, "cap": cap,
        "budget": budget, "bound": bound, "reads_per_forward": per_forward,
        "reads_warm_mean": sum(warm) / len(warm), "ratio": (sum(warm) / len(warm)) / max(bound, 1),
        "forward_s": [max(o["secs"][f] for o in outs) for f in range(args.forwards)],
        "trace": trace, "peak_trace_over_budget": max(trace[len(trace) // args.forwards:]) / budget,
        "plans": [o["plan"] for o in outs], "page_cache": [o["page_cache"] for o in outs],
        "read_mode": [o["read_mode"] for o in outs], "peers": [{"ranks": o["ranks"], "replicas": o["replicas"]} for o in outs],
    }


def figure(results: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=False)
    for ax, pair in zip(axes, ("ranks", "replicas")):
        for r in results:
            if r.get("pair") != pair or "trace" not in r:
                continue
            ax.plot([b / MIB for b in r["trace"]], label=f"{'coordinated' if r['coordinated'] else 'each alone'}")
            ax.axhline(r["budget"] / MIB, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{pair}: resident layer bytes at each layer")
        ax.set_xlabel("layer step (all forwards)")
        ax.set_ylabel("MiB resident (dashed: budget)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--forwards", type=int, default=4)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--figure", default=None)
    ap.add_argument("--reads", dest="read_mode", default="auto", choices=["auto", "mapping", "uncached"],
                    help="the children's reads (default auto: O_DIRECT where the files take it)")
    ap.add_argument("--pairs", default="ranks,replicas", help="comma-separated: ranks, replicas")
    ap.add_argument("--modes", default="coordinated,alone", help="comma-separated: coordinated, alone")
    args = ap.parse_args(argv)

    from _common import emit_json, machine, print_table

    try:
        from cgroups import memory_cgroup

        with memory_cgroup(NO_LIMIT):
            pass
    except OSError as exc:
        print(f"skipped: memory cgroups cannot be made here ({exc})")
        return 0
    print(f"machine: {machine()}")
    work = tempfile.mkdtemp(prefix="mapoffload-shared-", dir=args.dir)
    try:
        paths = write_checkpoints(work, args.layers, args.width)
        modes = [m.strip() for m in args.modes.split(",")]
        results = [run_pair(pair.strip(), coord, paths, args, work)
                   for pair in args.pairs.split(",") for coord in (True, False)
                   if ("coordinated" if coord else "alone") in modes]
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["pair"], "coordinated" if r["coordinated"] else "alone", "failed", "", "", "", "", ""])
            continue
        rows.append([r["pair"], "coordinated" if r["coordinated"] else "alone",
                     f"{r['reads_warm_mean'] / MIB:.0f}", f"{r['bound'] / MIB:.0f}", f"{r['ratio']:.2f}x",
                     f"{r['peak_trace_over_budget']:.2f}x", f"{sum(r['forward_s'][1:]) / max(1, len(r['forward_s']) - 1):.2f}",
                     f"{r['budget'] / MIB:.0f}"])
    print()
    print_table(["pair", "mode", "read MiB/fwd (pair)", "bound MiB", "read/bound", "peak resident/budget",
                 "fwd s", "budget MiB"], rows)
    for r in results:
        if "plans" in r:
            print(f"{r['pair']} {'coordinated' if r['coordinated'] else 'alone'}: " + " | ".join(r["plans"]))
            print("    " + " | ".join(r["page_cache"]))
        elif "error" in r:
            print(f"{r['pair']}: failed: {r['error']}")
    if args.figure:
        made = figure(results, args.figure)
        print(f"figure: {made or 'matplotlib missing (pip install .[bench])'}")
    emit_json("shared_cap", {"args": vars(args), "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
