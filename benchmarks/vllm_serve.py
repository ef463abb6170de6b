"""vLLM's CPU build serving a >= 1 GiB bf16 Llama: its default loader against
the ``mapoffload`` load format, in the same run.

Generates a ``LlamaConfig`` model (default hidden 2048, intermediate 5632,
12 layers, 16 heads, vocab 32000, untied: about 1.4 GiB in bfloat16), random
weights with a fixed seed, saved with ``save_pretrained`` into ``--dir``
(kept and reused when it holds the same model; its conversion folder is
removed first, so "first start" converts). Each contender is one fresh
process running ``vllm.LLM(...)`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``enforce_eager``, ``skip_tokenizer_init``), the
checkpoint warm in the page cache:

  dummy              load_format="dummy": vLLM's footprint with random weights (no checkpoint read)
  vllm               load_format="auto": vLLM's default loader (copies, packs for oneDNN)
  packed 1st / 2nd   load_format="mapoffload", {"keep_mapping": true, "linear": "packed"}; the 2nd maps the conversion
  mapped 1st / 2nd   load_format="mapoffload", {"keep_mapping": true, "linear": "mapped"}; the 2nd maps the conversion
  vnni 1st / 2nd     the mapped ones with {"linear": "vnni"}: linear weights packed for vLLM's small-GEMM kernel into
                     the conversion folder (AVX-512 BF16; elsewhere the same as mapped)
  mapped unstreamed  the mapped 2nd start with {"stream_layers": false} (no per-layer page-cache hooks)

Columns: ``LLM()`` seconds (import of vLLM apart: the same for all) and their
ratio to vLLM's; RssAnon / RssFile after init (``/proc/self/status`` of the
engine's process); anonymous MiB over vLLM's import and its KV cache (RssAnon
after init less RssAnon after ``import vllm`` less ``VLLM_CPU_KVCACHE_SPACE``):
everything else the engine holds, weights and vLLM's own buffers alike, so an
upper bound of what the weights cost. (The dummy loader is no footprint without
weights: it fills real, anonymous parameters, and holds what vLLM's loader
holds; its row shows it.) Decode tokens/s: ``--requests`` greedy requests of
``--tokens`` tokens at once (``ignore_eos``) after a short warm-up, the best of
``--rounds``; the requests' tokens compared with vLLM's. Then the replicas:
two engine processes at once on the folder, vLLM's loader and ours mapped (2nd
start), each after a short generate; the ``Pss`` of their mappings of the
folder's files (checkpoint and conversion, from ``/proc/PID/smaps``) plus their
anonymous MiB over import and KV cache, against one model.

Under caps (``--caps``, percent of the model): the mapped 2nd start again, in a
memory cgroup of its own footprint (RssAnon after init plus the files mapped
after ``import vllm``) plus that share of the model, the folder's pages
dropped first: decode tokens/s, bytes read from storage per forward
(``/proc/self/io``) against what the page-cache plan streams per forward, and
against the disk: the tokens/s its sequential rate (measured on the largest
checkpoint file, pages dropped) allows for the bytes read, ``requests`` tokens
a forward.

Paired decode (``--paired N``, default 4): engines of vLLM's loader, ours
packed, ours mapped and ours vnni started one after another and then kept alive
together; N turns in which each runs one decode round in order. Whatever
else loads the machine slows a turn's contenders alike: the decode target is
judged on the median of the turns' ratios (the rows above ran minutes apart).

Run: python benchmarks/vllm_serve.py [--dir /tmp/mapoffload-vllm-bench] [--hidden 2048]
     [--intermediate 5632] [--layers 12] [--vocab 32000] [--tokens 64] [--requests 4]
     [--rounds 2] [--no-replicas] [--caps 50,10] [--paired 4] [--only NAME,...] [--json out.json] [--figure out.svg]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))  # cgroups.py, smaps.py; appended: shadows nothing
MIB = 1 << 20
KEEP_PACKED = {"keep_mapping": True, "linear": "packed"}
KEEP_MAPPED = {"keep_mapping": True, "linear": "mapped"}
KEEP_VNNI = {**KEEP_MAPPED, "linear": "vnni"}  # mapped, packed for vLLM's small-GEMM kernel in the folder
# name, load_format, extra, measure decode
CONTENDERS = [
    ("dummy", "dummy", None, False),
    ("vllm", "auto", None, True),
    ("packed 1st", "mapoffload", KEEP_PACKED, False),
    ("packed 2nd", "mapoffload", KEEP_PACKED, True),
    ("mapped 1st", "mapoffload", KEEP_MAPPED, False),
    ("mapped 2nd", "mapoffload", KEEP_MAPPED, True),
    ("vnni 1st", "mapoffload", KEEP_VNNI, False),
    ("vnni 2nd", "mapoffload", KEEP_VNNI, True),
]
# Beside the contenders: the mapped 2nd start without the decoder layers streamed through the page
# cache (stream_layers false: no per-layer hooks), what the hooks cost a decode step.
EXTRA = {
    "mapped unstreamed": ("mapoffload", {**KEEP_MAPPED, "stream_layers": False}, True, {}),
}
REPLICAS = [("vllm", "auto", None), ("mapped", "mapoffload", KEEP_MAPPED)]


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]


def _read_bytes() -> int:
    """Bytes this process has had read from storage (``/proc/self/io``: page cache hits are not reads)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _plan_of(model) -> dict | None:  # noqa: ANN001
    """What the page-cache coordinator planned for the model's stacks: cached and streamed bytes."""
    handle = getattr(model, "mapoffload_handle", None)
    if handle is None or not handle.managers:
        return None
    from mapoffload.pagecache.coordinator import coordinator

    plans = [m.residency for m in coordinator().members() if m.residency is not None]
    return {"cached": sum(p.cached_bytes for p in plans), "streamed": sum(p.streamed_bytes for p in plans),
            "always": max((p.always_bytes for p in plans), default=0), "describe": coordinator().describe()}


def child(spec: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_gib"])
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t0
    after_import = _status()
    kwargs = {}
    if spec["extra"] is not None:
        kwargs["model_loader_extra_config"] = spec["extra"]
    t1 = time.perf_counter()
    llm = LLM(model=spec["folder"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=256, load_format=spec["load_format"], seed=0, **kwargs)
    init_s = time.perf_counter() - t1
    after_init = _status()

    def bound_of(model):  # noqa: ANN001, ANN202
        b = getattr(model, "mapoffload_bound", None)
        return None if b is None else {"mapped": b.mapped, "converted": b.converted, "copied": b.copied,
                                       "reused": b.reused, "folder": b.folder}

    kv = int(spec["kv_gib"] * 2**30)
    result = {"name": spec["name"], "import_s": import_s, "init_s": init_s, "after_import": after_import,
              "after_init": after_init, "kv_bytes": kv, "bound": llm.apply_model(bound_of)[0],
              "anon_over_base": after_init["RssAnon"] - after_import["RssAnon"] - kv}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(spec["requests"], spec["vocab"])]
    if spec.get("replica"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        result["after_generate"] = _status()
        result["anon_over_base"] = result["after_generate"]["RssAnon"] - after_import["RssAnon"] - kv
        print("READY " + json.dumps(result), flush=True)
        sys.stdin.readline()  # the parent has read our smaps
        return
    if spec.get("paired"):  # one decode round per line on stdin, while the other contenders wait their turn
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        sp = SamplingParams(max_tokens=spec["tokens"], temperature=0, ignore_eos=True)
        print("READY " + json.dumps(result), flush=True)
        for _ in sys.stdin:
            t2 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            took = time.perf_counter() - t2
            print("ROUND " + json.dumps({"s": took, "generated": sum(len(o.outputs[0].token_ids) for o in outs)}),
                  flush=True)
        return
    if spec["decode"]:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        sp = SamplingParams(max_tokens=spec["tokens"], temperature=0, ignore_eos=True)
        rounds, reads = [], []
        for _ in range(spec["rounds"]):
            r0 = _read_bytes()
            t2 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            rounds.append(time.perf_counter() - t2)
            reads.append(_read_bytes() - r0)
        result["decode_rounds_s"] = rounds
        # a round is a prefill of every request and tokens - 1 decode steps: one forward each
        result["read_per_forward"] = min(reads) / spec["tokens"]
        result["plan"] = llm.apply_model(_plan_of)[0]
        result["decode_s"] = min(rounds)
        result["generated"] = sum(len(o.outputs[0].token_ids) for o in outs)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["after_decode"] = _status()
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(spec: dict, log) -> subprocess.Popen:  # noqa: ANN001
    cgroup = spec.get("cgroup")

    def join() -> None:
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    return subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdin=subprocess.PIPE,
                            preexec_fn=join,
                            stdout=subprocess.PIPE, stderr=log, text=True)


def _run(spec: dict, log_path: str) -> dict:
    with open(log_path, "a") as log:
        log.write(f"\n===== {spec['name']} =====\n")
        log.flush()
        proc = _spawn(spec, log)
        out, _ = proc.communicate(timeout=1200)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        with open(log_path) as f:
            sys.stderr.write(f.read()[-6000:])
        raise SystemExit(f"{spec['name']}: child failed (rc {proc.returncode}); log in {log_path}")
    return json.loads(lines[-1][len("RESULT "):])


def _replicas(spec: dict, log_path: str, folder: str) -> dict:
    """Two engines at once on ``folder``: their Pss of its files and their anonymous memory."""
    from smaps import pss_under

    with open(log_path, "a") as log:
        log.write(f"\n===== replicas {spec['name']} =====\n")
        log.flush()
        procs = [_spawn({**spec, "replica": True}, log) for _ in range(2)]
        ready = []
        try:
            for p in procs:
                while True:
                    line = p.stdout.readline()
                    if not line:
                        raise SystemExit(f"replica {spec['name']}: exited (rc {p.wait()}); log in {log_path}")
                    if line.startswith("READY "):
                        ready.append(json.loads(line[len("READY "):]))
                        break
            pss = [pss_under(p.pid, folder) for p in procs]
            anon = []
            for p in procs:
                with open(f"/proc/{p.pid}/status") as f:
                    anon += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon:")]
        finally:
            for p in procs:
                try:
                    p.stdin.write("\n")
                    p.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            for p in procs:
                p.wait(timeout=120)
    return {"name": spec["name"], "pss_files": pss, "anon": anon, "init_s": [r["init_s"] for r in ready],
            "anon_over_base": [r["anon_over_base"] for r in ready]}


def _paired(base: dict, log_path: str, rounds: int) -> dict:
    """Decode rounds taken in turn by engines alive at once (vLLM's loader, ours packed, ours mapped):
    whatever else the machine runs slows every contender of a turn alike, so the ratios within a
    turn compare them where one-after-another runs compare the load."""
    names = [("vllm", "auto", None), ("packed", "mapoffload", KEEP_PACKED), ("mapped", "mapoffload", KEEP_MAPPED),
             ("vnni", "mapoffload", KEEP_VNNI)]
    with open(log_path, "a") as log:
        log.write("\n===== paired decode =====\n")
        log.flush()
        procs = {}
        try:
            for name, fmt, extra in names:  # one at a time: each start has the machine to itself
                p = procs[name] = _spawn({**base, "name": f"paired {name}", "load_format": fmt, "extra": extra,
                                          "decode": False, "paired": True}, log)
                _wait_for(p, "READY ", name, log_path)
            tps = {name: [] for name in procs}
            for _ in range(rounds):
                for name, p in procs.items():
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    r = json.loads(_wait_for(p, "ROUND ", name, log_path))
                    tps[name].append(r["generated"] / r["s"])
        finally:
            for p in procs.values():
                try:
                    p.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            for p in procs.values():
                p.wait(timeout=120)
    return {"rounds": tps, "best": {n: max(v) for n, v in tps.items()},
            "turn_ratios": {n: [a / b for a, b in zip(v, tps["vllm"])] for n, v in tps.items()}}


def _wait_for(p: subprocess.Popen, prefix: str, name: str, log_path: str) -> str:
    while True:
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"paired {name}: exited (rc {p.wait()}); log in {log_path}")
        if line.startswith(prefix):
            return line[len(prefix):]


def _disk_rate(path: str) -> float:
    """Bytes per second reading ``path`` sequentially from storage (its pages dropped first)."""
    from _common import drop_caches

    drop_caches([path])
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        n = 0
        while True:
            chunk = f.read(16 * MIB)
            if not chunk:
                break
            n += len(chunk)
    return n / (time.perf_counter() - t0)


def _capped(args, base: dict, by: dict, log_path: str, folder: str, weights: int) -> dict:  # noqa: ANN001
    """The mapped 2nd start under each cap of ``--caps``: a memory cgroup of the engine's own footprint
    (its anonymous memory after init and the files it had mapped after importing vLLM) plus that percent
    of the model, the folder's pages dropped before each run (a cold host)."""
    from _common import drop_caches
    from cgroups import memory_cgroup

    mapped2 = by["mapped 2nd"]
    footprint = mapped2["after_init"]["RssAnon"] + mapped2["after_import"]["RssFile"]
    files = [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names
             if n.endswith(".safetensors") or n.startswith("part-")]
    rate = _disk_rate(max(files, key=os.path.getsize))
    print(f"  disk: {rate / 1e6:.0f} MB/s sequential (the largest checkpoint file, its pages dropped first)")
    out = {"footprint": footprint, "disk_bytes_per_s": rate, "runs": []}
    for pct in (int(c) for c in args.caps.split(",") if c.strip()):
        limit = footprint + pct * weights // 100
        drop_caches(files)
        run = {"pct": pct, "limit": limit}
        try:
            with memory_cgroup(limit) as cgroup:
                spec = {**base, "name": f"mapped +{pct}%", "load_format": "mapoffload", "extra": KEEP_MAPPED,
                        "decode": True, "cgroup": cgroup}
                try:
                    run.update(_run(spec, log_path))
                except SystemExit as exc:  # killed under the cap: a row that says so
                    run["error"] = str(exc)
        except OSError as exc:
            out["skipped"] = str(exc)
            print(f"  caps skipped: {exc}")
            break
        if "decode_s" in run:
            run["tokens_per_s"] = run["generated"] / run["decode_s"]
            per = run["read_per_forward"]
            run["allowed_tokens_per_s"] = args.requests * rate / per if per > 0 else None
            run["allowed_ratio"] = run["tokens_per_s"] / run["allowed_tokens_per_s"] if per > 0 else None
        run["load_average"] = _load()
        out["runs"].append(run)
        print(f"  mapped +{pct}%: cap {limit / MIB:.0f} MiB, "
              + (f"{run['tokens_per_s']:.2f} tok/s, {run['read_per_forward'] / MIB:.0f} MiB read per forward"
                 if "tokens_per_s" in run else f"failed: {run.get('error', '?')[:200]}")
              + f" (load {run['load_average']})", flush=True)
    return out


def _paired_table(paired: dict) -> None:
    from statistics import median

    from _common import print_table

    rows = []
    for name, tps in paired["rounds"].items():
        ratios = paired["turn_ratios"][name]
        rows.append([name, " ".join(f"{t:.1f}" for t in tps), f"{max(tps):.2f}",
                     f"{max(tps) / paired['best']['vllm']:.2f}x", f"{median(ratios):.2f}x"])
    print_table(["paired decode", "tok/s per turn", "best tok/s", "best vs vllm's best", "median of turn ratios"],
                rows)


def _capped_table(capped: dict, vllm: dict, requests: int) -> None:
    from _common import print_table

    rows = []
    for r in capped["runs"]:
        if "tokens_per_s" not in r:
            rows.append([f"+{r['pct']} %", f"{r['limit'] / MIB:.0f}", "failed", "-", "-", "-", "-", "-", "-"])
            continue
        plan = r.get("plan") or {}
        streamed = plan.get("streamed")
        rows.append([
            f"+{r['pct']} %", f"{r['limit'] / MIB:.0f}", f"{r['tokens_per_s']:.2f}",
            f"{r['tokens_per_s'] / vllm['tokens_per_s']:.2f}x", f"{r['read_per_forward'] / MIB:.0f}",
            "-" if streamed is None else f"{streamed / MIB:.0f}",
            "-" if not streamed else f"{r['read_per_forward'] / streamed:.2f}x",
            "-" if r["allowed_tokens_per_s"] is None else f"{r['allowed_tokens_per_s']:.2f}",
            "-" if r["allowed_ratio"] is None else f"{r['allowed_ratio']:.2f}x"])
    print_table(["cap over footprint", "cgroup MiB", "decode tok/s", "vs vllm uncapped", "read per forward MiB",
                 "plan streams MiB", "read / plan", f"tok/s the disk allows ({capped['disk_bytes_per_s'] / 1e6:.0f} MB/s)",
                 "vs disk"], rows)


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".safetensors"))


def build(args: argparse.Namespace) -> str:
    """Save the model into ``args.dir`` unless it holds this very model already."""
    want = {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "vocab": args.vocab, "seed": 0}
    marker = os.path.join(args.dir, "bench-model.json")
    try:
        with open(marker) as f:
            if json.load(f) == want:
                print(f"model: reusing {args.dir}")
                return args.dir
    except (OSError, ValueError):
        pass
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(args.dir)
    del model
    with open(marker, "w") as f:
        json.dump(want, f)
    print(f"model: saved to {args.dir} in {time.perf_counter() - t0:.1f} s")
    return args.dir


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("MAPOFFLOAD_BENCH_DIR", "/tmp"),
                                                  "mapoffload-vllm-bench"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request in the decode measurement")
    ap.add_argument("--requests", type=int, default=4, help="greedy requests at once in the decode measurement")
    ap.add_argument("--rounds", type=int, default=2, help="decode measurements per contender (the best counts)")
    ap.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of every engine")
    ap.add_argument("--no-replicas", action="store_true", help="skip the two-replica PSS measurement")
    ap.add_argument("--caps", default="50,10",
                    help="comma-separated caps, in percent of the model over the mapped engine's own footprint, "
                         "to serve the mapped 2nd start under (a memory cgroup each; '' for none)")
    ap.add_argument("--paired", type=int, default=4,
                    help="decode rounds taken in turn by vllm, packed and mapped engines alive at once (0: none): "
                         "the decode target is judged on these")
    ap.add_argument("--only", help="comma-separated contenders to run (vllm always runs: the ratios' base); "
                                   "the targets are judged only where their contenders ran")
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--figure", help="also draw the figure here (.svg or .png; needs matplotlib)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0

    from _common import emit_json, machine, print_table

    args.dir = os.path.abspath(args.dir)
    print(f"machine: {machine()}; load average {_load()}")
    folder = build(args)
    shutil.rmtree(os.path.join(folder, ".mapoffload-converted"), ignore_errors=True)
    folder = os.path.realpath(folder)
    weights = _folder_bytes(folder)
    print(f"model: {weights / 2**30:.2f} GiB bf16 ({args.layers} layers, hidden {args.hidden}, "
          f"intermediate {args.intermediate}, vocab {args.vocab})")
    for path in (os.path.join(folder, n) for n in os.listdir(folder)):  # warm: every contender alike
        if os.path.isfile(path):
            with open(path, "rb") as f:
                while f.read(64 * MIB):
                    pass
    log_path = os.path.join(folder, "bench.log")
    open(log_path, "w").close()
    base = {"folder": folder, "tokens": args.tokens, "requests": args.requests, "vocab": args.vocab,
            "rounds": args.rounds, "kv_gib": args.kv_gib}
    results = []
    t_all = time.perf_counter()
    runs = [(name, fmt, extra, decode, {}) for name, fmt, extra, decode in CONTENDERS]
    runs += [(name, *spec) for name, spec in EXTRA.items()]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        unknown = sorted(set(wanted) - {r[0] for r in runs})
        if unknown:
            raise SystemExit(f"--only: unknown contender(s) {unknown}; there are {[r[0] for r in runs]}")
        runs = [r for r in runs if r[0] in wanted or r[0] == "vllm"]
    for name, load_format, extra, decode, more in runs:
        r = _run({**base, "name": name, "load_format": load_format, "extra": extra, "decode": decode, **more},
                 log_path)
        r["load_average"] = _load()
        results.append(r)
        print(f"  {name}: LLM() {r['init_s']:.1f} s, RssAnon {r['after_init']['RssAnon'] / MIB:.0f} MiB"
              + (f", {r['generated'] / r['decode_s']:.2f} tok/s" if "decode_s" in r else "")
              + f" (load {r['load_average']})", flush=True)
    replicas = []
    if not args.no_replicas:
        for name, load_format, extra in REPLICAS:
            rep = _replicas({**base, "name": name, "load_format": load_format, "extra": extra, "decode": False},
                            log_path, folder)
            replicas.append(rep)
            print(f"  replicas {name}: Pss of the folder's files {[round(x / MIB) for x in rep['pss_files']]} MiB, "
                  f"RssAnon {[round(x / MIB) for x in rep['anon']]} MiB", flush=True)
    by = {r["name"]: r for r in results}
    paired = _paired(base, log_path, args.paired) if args.paired else {}
    capped = _capped(args, base, by, log_path, folder, weights) if args.caps and "mapped 2nd" in by else {}
    total_s = time.perf_counter() - t_all

    vllm = by["vllm"]
    rows = []
    for r in results:
        b = r["bound"]
        tok_s = r["generated"] / r["decode_s"] if "decode_s" in r else None
        r["tokens_per_s"] = tok_s
        rows.append([
            r["name"], f"{r['init_s']:.1f}", f"{r['init_s'] / vllm['init_s']:.2f}x",
            f"{r['import_s'] + r['init_s']:.1f}", f"{r['after_init']['RssAnon'] / MIB:.0f}",
            f"{r['after_init']['RssFile'] / MIB:.0f}", f"{r['anon_over_base'] / MIB:.0f}",
            f"{100 * r['anon_over_base'] / weights:.1f}",
            "-" if b is None else f"{b['mapped'] / MIB:.0f} / {b['converted'] / MIB:.0f} / {b['copied'] / MIB:.0f}",
            "-" if tok_s is None else f"{tok_s:.2f}",
            "-" if tok_s is None else f"{tok_s / vllm['tokens_per_s']:.2f}x",
            "-" if "tokens" not in r else str(r["tokens"] == vllm["tokens"]),
        ])
    print()
    print_table(["contender", "LLM() s", "vs vllm", "import+LLM() s", "RssAnon MiB", "RssFile MiB",
                 "anon over import+KV MiB", "% of model", "mapped / converted / copied MiB", "decode tok/s",
                 "vs vllm", "tokens == vllm"], rows)
    if replicas:
        rrows = []
        for rep in replicas:
            pss, over = sum(rep["pss_files"]), sum(rep["anon_over_base"])
            rep["weights_total"] = pss + over
            rrows.append([rep["name"], " + ".join(f"{x / MIB:.0f}" for x in rep["pss_files"]),
                          " + ".join(f"{x / MIB:.0f}" for x in rep["anon_over_base"]),
                          f"{(pss + over) / MIB:.0f}", f"{(pss + over) / weights:.2f}x"])
        print()
        print_table(["two replicas", "Pss of the folder's files MiB", "anon over import+KV MiB",
                     "sum MiB", "vs one model"], rrows)

    if capped.get("runs"):
        print()
        _capped_table(capped, by["vllm"], args.requests)
    if paired:
        print()
        _paired_table(paired)
    payload = {"weights_bytes": weights, "args": {k: v for k, v in vars(args).items() if k != "child"},
               "results": results, "replicas": replicas, "capped": capped, "paired": paired, "total_s": total_s}
    if "mapped 2nd" not in by or "packed 2nd" not in by:
        return _emit(payload, args)
    mapped2, packed2 = by["mapped 2nd"], by["packed 2nd"]
    limit = 0.05 * weights + 64 * MIB
    targets = {
        "anon_mapped": [mapped2["anon_over_base"], limit, mapped2["anon_over_base"] <= limit],
        "second_start_mapped": [mapped2["init_s"] / vllm["init_s"], 1.2, mapped2["init_s"] <= 1.2 * vllm["init_s"]],
        "second_start_packed": [packed2["init_s"] / vllm["init_s"], 1.2, packed2["init_s"] <= 1.2 * vllm["init_s"]],
        "mapped_decode_vs_vllm_packed": _decode_target(paired, "mapped", mapped2, vllm),
    }
    if "vnni 2nd" in by:
        targets["vnni_decode_vs_vllm_packed"] = _decode_target(paired, "vnni", by["vnni 2nd"], vllm)
    if replicas:
        ours = next(r for r in replicas if r["name"] == "mapped")
        targets["replicas_mapped"] = [ours["weights_total"] / weights, 1.1, ours["weights_total"] <= 1.1 * weights]
    print(f"\ntotal {total_s:.0f} s; load average now {_load()}")
    print(f"target: mapped anon over import+KV <= 5 % + 64 MiB = {limit / MIB:.0f} MiB: "
          f"{mapped2['anon_over_base'] / MIB:.0f} MiB ({'met' if targets['anon_mapped'][2] else 'MISSED'})")
    for key, label in (("second_start_mapped", "mapped 2nd start"), ("second_start_packed", "packed 2nd start")):
        v, lim, ok = targets[key]
        print(f"target: {label} <= 1.2x vLLM's LLM() seconds: {v:.2f}x ({'met' if ok else 'MISSED'})")
    for run in capped.get("runs", []):
        if run.get("allowed_ratio") is not None and run["pct"] == 50:
            ok = run["allowed_ratio"] >= 0.8
            targets["capped_50_vs_disk"] = [run["allowed_ratio"], 0.8, ok]
            print(f"target: under +50 % >= 0.8x the tokens/s the disk allows for its reads: "
                  f"{run['allowed_ratio']:.2f}x ({'met' if ok else 'MISSED'})")
    for key, label in (("mapped_decode_vs_vllm_packed", "mapped"), ("vnni_decode_vs_vllm_packed", "vnni")):
        if key in targets:
            v, lim, ok = targets[key]
            print(f"target: {label} decode >= 0.8x vLLM's packed decode ({'paired rounds' if paired else 'rows'}): "
                  f"{v:.2f}x ({'met' if ok else 'MISSED'})")
    if "replicas_mapped" in targets:
        v, lim, ok = targets["replicas_mapped"]
        print(f"target: two mapped replicas <= 1.1x one model: {v:.2f}x ({'met' if ok else 'MISSED'})")
    return _emit({**payload, "targets": targets}, args)


def _decode_target(paired: dict, name: str, row: dict, vllm: dict) -> list:
    """[ratio, 0.8, met]: the median of the paired turns' ``name`` / vllm ratios where they ran (a best
    against a best compares two moments of the load), else the rows'."""
    from statistics import median

    ratio = median(paired["turn_ratios"][name]) if paired else row["tokens_per_s"] / vllm["tokens_per_s"]
    return [ratio, 0.8, ratio >= 0.8]


def _emit(payload: dict, args: argparse.Namespace) -> int:
    """The JSON (stdout, and ``--json``), then the figure (``--figure``)."""
    from _common import emit_json, machine

    emit_json("vllm_serve", payload, args.json)
    if args.figure:
        from _figure import vllm_serve_figure

        vllm_serve_figure({**payload, "machine": machine(), "date": time.strftime("%Y-%m-%d")}, args.figure)
        print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
