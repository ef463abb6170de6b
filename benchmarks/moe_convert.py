"""A mixture-of-experts checkpoint whose experts transformers fuses on load:
transformers' ``from_pretrained`` against ``mapoffload.from_pretrained``.

transformers 5 saves a Mixtral-style model with one tensor per expert and
stacks them into one 3-D parameter per layer when it loads: every expert byte
becomes anonymous memory. mapoffload lets transformers do exactly that
conversion, writes each fused tensor into a conversion folder as it is made
(a bounded batch at a time) and maps it; the next load maps the folder
without converting.

Generates a ``MixtralConfig`` model (default hidden 1024, intermediate 2048,
8 experts, 8 layers, vocab 32000: about 1.5 GiB in bfloat16), random weights
with a fixed seed, saved with ``save_pretrained(max_shard_size="500MB")``
into a temporary folder (``--dir``; deleted afterwards). Each contender runs
in a fresh process with the checkpoint warm in the page cache:

  transformers          AutoModelForCausalLM.from_pretrained(folder, dtype=bfloat16)
  mapoffload (convert)  mapoffload.from_pretrained(..., device=None), no conversion folder yet
  mapoffload (reuse)    the same again: the conversion folder is mapped

Columns: peak and final RssAnon growth during the load (sampled every 10 ms
from /proc/self/status), load seconds, bytes of the model on file mappings
(``MappedRegions``), bytes converted, and whether the logits of one forward
equal transformers' (torch.equal).

Run: python benchmarks/moe_convert.py [--hidden 1024] [--intermediate 2048]
     [--experts 8] [--layers 8] [--dir /var/tmp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MIB = 1 << 20
CONTENDERS = ("transformers", "mapoffload (convert)", "mapoffload (reuse)")


def child(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import mapoffload
    import mapoffload.hf.transformers  # noqa: F401  (imported before the baseline)
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    from _common import AnonSampler
    from mapoffload.memory.budget import rss_anon_bytes

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base = rss_anon_bytes()
    sampler = AnonSampler(rss_anon_bytes)
    sampler.start()
    t0 = time.perf_counter()
    if args.contender == "transformers":
        model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.bfloat16).eval()
        converted = 0
    else:
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device=None,
                                           cache_dir=args.cache_dir)
        converted = model.mapoffload_report.bytes_converted
    seconds = time.perf_counter() - t0
    peak = sampler.stop() - base
    after = rss_anon_bytes() - base
    tensors = list({t.data_ptr(): t for t in model.state_dict().values()}.values())
    mapped = sum(t.numel() * t.element_size() for t, h in zip(tensors, mapoffload.MappedRegions().classify(tensors))
                 if h)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    torch.save(logits, args.logits)
    print("ROW " + json.dumps({"contender": args.contender, "load_s": seconds, "anon_peak": peak,
                               "anon_after": after, "mapped": mapped, "converted": converted}), flush=True)


def build(args: argparse.Namespace, folder: str) -> int:
    import torch
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                           num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tf.MixtralForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    model.save_pretrained(folder, max_shard_size="500MB")
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", default=None, help="where the temporary checkpoint goes (a disk, not tmpfs)")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--logits", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.contender = args.child
        child(args)
        return
    import torch

    from _common import emit_json, machine, print_table

    work = tempfile.mkdtemp(prefix="moe-convert-", dir=args.dir)
    try:
        folder, cache = os.path.join(work, "model"), os.path.join(work, "converted")
        size = build(args, folder)
        for f in os.listdir(folder):  # warm: the loads, not the disk, are compared
            with open(os.path.join(folder, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass
        rows, logits = [], {}
        for contender in CONTENDERS:
            out = os.path.join(work, f"logits-{len(rows)}.pt")
            proc = subprocess.run([sys.executable, __file__, "--child", contender, "--folder", folder,
                                   "--cache-dir", cache, "--logits", out], capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")), None)
            if line is None:
                raise RuntimeError(f"{contender} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            rows.append(json.loads(line[4:]))
            logits[contender] = torch.load(out)
        for r in rows:
            r["logits_equal"] = bool(torch.equal(logits["transformers"], logits[r["contender"]]))
        print(f"# moe_convert: Mixtral-style, {args.layers} layers x {args.experts} experts, hidden {args.hidden}, "
              f"bfloat16, checkpoint {size / MIB:.0f} MiB; {machine()}")
        base = rows[0]
        print_table(
            ["contender", "anon peak MiB", "anon after MiB", "peak vs transformers", "load s", "load vs transformers",
             "on mapping MiB", "converted MiB", "logits =="],
            [[r["contender"], f"{r['anon_peak'] / MIB:.0f}", f"{r['anon_after'] / MIB:.0f}",
              f"{r['anon_peak'] / base['anon_peak']:.2f}x", f"{r['load_s']:.2f}",
              f"{r['load_s'] / base['load_s']:.2f}x", f"{r['mapped'] / MIB:.0f}", f"{r['converted'] / MIB:.0f}",
              r["logits_equal"]] for r in rows])
        emit_json("moe_convert", {"checkpoint_bytes": size, "layers": args.layers, "experts": args.experts,
                                  "hidden": args.hidden, "rows": rows}, args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
