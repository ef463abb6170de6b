"""A real-architecture model from its folder: transformers' ``from_pretrained``
against ``mapoffload.from_pretrained``.

Generates a Llama-style model from a ``transformers.LlamaConfig`` (default
hidden 2048, intermediate 5632, 16 layers, vocab 32000: about 1.8 GiB in
bfloat16), random weights drawn with a fixed seed directly in the target dtype,
saved with ``save_pretrained(max_shard_size="500MB")`` into a temporary folder
(``--dir``; deleted afterwards). Then, each in a fresh process (this script
with a hidden ``--child`` mode), loads it

  transformers       AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE)
  mapoffload         mapoffload.from_pretrained(AutoModelForCausalLM, folder, device="cpu")
                     (keep_mapping=None: the gate copies when copies fit the host)
  mapoffload-mapped  the same with keep_mapping=True

in two rounds: "cold" (every checkpoint file dropped from the page cache with
``mapoffload.drop_page_cache`` before the process starts) and "warm" (every
file read into the page cache first). In each process, after the imports
(transformers' modeling_llama included: it is imported lazily, and its ~80 MiB
are not the load's):

  anon after load / forward   RssAnon growth (/proc/self/status) measured
                              once after the load and once after the first
                              forward (not a peak)
  load s                      wall seconds of the load call
  forward s                   wall seconds of the first forward of a fixed
                              batch of token ids (--batch x --seq, seed 0)
                              under torch.inference_mode()
  on file mapping MiB         bytes of the model's distinct parameters and
                              buffers held by file mappings
                              (MappedRegions().mapped_bytes), measured after
                              the forward (for mapoffload after handle.close(),
                              which puts the streamed layers' weights back);
                              for mapoffload also its LoadReport's
                              bytes_mapped / bytes_copied
  logits ==                   torch.equal of the logits with those of the
                              cold transformers run

Run: python benchmarks/hf_load.py [--dtype bfloat16|float32] [--hidden 2048]
     [--intermediate 5632] [--layers 16] [--vocab 32000] [--seq 128]
     [--contenders transformers,mapoffload,mapoffload-mapped] [--threads N]
     [--dir /a/disk/not/tmpfs] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONTENDERS = ("transformers", "mapoffload", "mapoffload-mapped")
ROUNDS = ("cold", "warm")
MIB = 1 << 20


# --- inside a fresh process --------------------------------------------------------------------


def _distinct_tensors(model) -> list:
    """Every parameter and buffer of the model once (ties counted once)."""
    seen: set[int] = set()
    out = []
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and t.device.type == "cpu" and t.numel():
            seen.add(id(t))
            out.append(t)
    return out


def child(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import mapoffload
    import mapoffload.hf.transformers  # noqa: F401  (imported before the baseline, as modeling_llama)
    import transformers.models.llama.modeling_llama  # noqa: F401  (lazy in transformers: not the load's cost)
    from mapoffload.memory.budget import rss_anon_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    anon0 = rss_anon_bytes()

    t0 = time.perf_counter()
    if args.contender == "transformers":
        model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype)
        model.eval()
    elif args.contender == "mapoffload":
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device="cpu")
    else:
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device="cpu", keep_mapping=True)
    load_s = time.perf_counter() - t0
    anon_load = rss_anon_bytes() - anon0

    row = {"contender": args.contender, "round": args.round, "load_s": load_s, "anon_after_load": anon_load}
    report = getattr(model, "mapoffload_report", None)
    if report is not None:
        row["report_bytes_mapped"] = report.bytes_mapped
        row["report_bytes_copied"] = report.bytes_copied
        row["report_copied"] = dict(report.copied)
        row["report_keep_mapping"] = report.keep_mapping

    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        row["forward_s"] = time.perf_counter() - t0
    row["anon_after_forward"] = rss_anon_bytes() - anon0
    torch.save(logits.clone(), args.out)
    handle = getattr(model, "mapoffload_handle", None)
    if handle is not None:
        row["summary"] = str(handle.summary()).splitlines()
        handle.close()  # the model whole again: the streamed layers' real weights back in place
    tensors = _distinct_tensors(model)
    row["tensor_bytes"] = sum(t.nbytes for t in tensors)
    row["mapped_bytes"] = mapoffload.MappedRegions().mapped_bytes(tensors)
    row["param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    print("ROW " + json.dumps(row))


# --- the launcher ------------------------------------------------------------------------------


def generate(folder: str, args: argparse.Namespace) -> dict:
    """Write the random Llama-style model; returns its sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.seq), tie_word_embeddings=bool(getattr(args, "tie", False)),
    )
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device="cpu")  # buffers are not saved: only parameters need values
    model.tie_weights()  # to_empty made new parameters: a tied head is the embedding again (saved once)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                for chunk in p.view(-1).split(1 << 24):  # 16 Mi elements at a time
                    chunk.normal_(0.0, 0.02, generator=gen)
    model.config.dtype = dtype
    model.save_pretrained(folder, max_shard_size="500MB")
    seconds = time.perf_counter() - t0
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.nbytes for p in model.parameters()),
        "checkpoint_bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in files),
        "shards": len(files),
        "generate_s": seconds,
    }


def _checkpoint_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _read_all(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 * MIB):
            pass


def run(contender: str, rnd: str, folder: str, out: str, args: argparse.Namespace) -> dict:
    from mapoffload import drop_page_cache

    for path in _checkpoint_files(folder):
        if rnd == "cold":
            drop_page_cache(path)
        else:
            _read_all(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--contender", contender, "--round", rnd,
           "--folder", folder, "--out", out, "--dtype", args.dtype, "--vocab", str(args.vocab),
           "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{contender} ({rnd}): exit {proc.returncode}\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if not lines:
        raise RuntimeError(f"{contender} ({rnd}): no result line\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    row = json.loads(lines[-1][4:])
    row["stderr_tail"] = proc.stderr.strip().splitlines()[-3:]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 64)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = heads)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the loading processes (0: torch's)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="which to run (transformers always runs: its cold logits are the reference)")
    ap.add_argument("--dir", default=None, help="where to write the model (a disk, not tmpfs)")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    # inside a fresh process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--round", choices=ROUNDS, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    args.heads = args.heads or max(1, args.hidden // 64)
    args.kv_heads = args.kv_heads or args.heads
    chosen = [c for c in args.contenders.split(",") if c]
    bad = [c for c in chosen if c not in CONTENDERS]
    if bad:
        ap.error(f"unknown contenders {bad}; choose from {CONTENDERS}")
    contenders = [c for c in CONTENDERS if c == "transformers" or c in chosen]

    import torch

    from _common import emit_json, machine, print_table

    print(f"machine: {machine()}")
    results = []
    with tempfile.TemporaryDirectory(prefix="mapoffload-hf-load-", dir=args.dir) as work:
        folder = os.path.join(work, "model")
        sizes = generate(folder, args)
        print(f"model: Llama-style, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
              f"vocab {args.vocab}, {args.dtype}: {sizes['params'] / 1e6:.1f} M parameters, "
              f"{sizes['checkpoint_bytes'] / MIB:.1f} MiB in {sizes['shards']} shard(s), "
              f"generated in {sizes['generate_s']:.1f} s")
        logits = {}
        for rnd in ROUNDS:
            for contender in contenders:
                out = os.path.join(work, f"logits-{contender}-{rnd}.pt")
                results.append(run(contender, rnd, folder, out, args))
                logits[(contender, rnd)] = torch.load(out)
    ref = logits[("transformers", "cold")]
    for r in results:
        r["logits_equal"] = torch.equal(logits[(r["contender"], r["round"])], ref)

    mib = lambda b: f"{b / MIB:.1f}"  # noqa: E731
    rows = []
    for r in results:
        mapped = mib(r["mapped_bytes"])
        if "report_bytes_mapped" in r:
            mapped += f" (report {mib(r['report_bytes_mapped'])} mapped, {mib(r['report_bytes_copied'])} copied)"
        rows.append([r["contender"], r["round"], mib(r["anon_after_load"]), mib(r["anon_after_forward"]),
                     f"{r['load_s']:.3f}", f"{r['forward_s']:.3f}", mapped,
                     "yes" if r["logits_equal"] else "NO"])
    print()
    print_table(["contender", "page cache", "RssAnon Δ after load MiB", "RssAnon Δ after forward MiB", "load s",
                 "first forward s", "on file mapping MiB", "logits == transformers"], rows)
    emit_json("hf_load", {
        "dtype": args.dtype, "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
        "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
        "threads": args.threads or torch.get_num_threads(), "transformers": _version("transformers"),
        "torch": torch.__version__, **sizes, "results": results,
    }, args.json)
    return 0


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
