"""A diffusion pipeline's step under a memory limit (issue 43): diffusers' own load against
``mapoffload.pipeline_from_pretrained(..., device="cpu")``, each step timed, its reads counted.

The seeds' scenario, generated here (no hub): a PixArt-alpha pipeline from diffusers' own classes -
a ``PixArtTransformer2DModel`` of ``--blocks`` blocks (default 16 blocks of 16 heads x 64, float32:
about 1.0 GiB), a small T5 encoder and VAE - with random weights drawn with a fixed seed, saved with
``save_pretrained`` under ``--dir`` (a disk, not tmpfs; deleted afterwards unless ``--keep``). Each run
is a fresh process (this script with a hidden ``--child`` mode) started cold (``sync`` and
``drop_caches``; where not permitted, only the pipeline's files are dropped), in a memory cgroup of its
own made under this process's cgroup:

  diffusers   PixArtAlphaPipeline.from_pretrained(folder), uncapped: the reference image
  mapoffload  pipeline_from_pretrained(PixArtAlphaPipeline, folder, device="cpu"), uncapped, then under
              each limit of --caps: the cgroup's usage once the libraries are imported, plus the uncapped
              run's own growth of anonymous memory (its peak less its baseline), plus that percentage of
              the transformer's bytes

Each run calls the pipeline twice (``--steps`` steps, guidance 4.5, ``--size`` pixels, the prompt given
as embeddings: no tokenizer files), the first warming up; the second's transformer calls are the steps
timed (each a forward of the transformer over the batch of two that guidance makes), with the bytes the
process read in each (``/proc/self/io``). The disk's speed is measured once (cold sequential reads of
the pipeline's files, the faster of ``read()`` and a mapping populated in 2 MiB folios: ``_common.disk_read``).

Printed, as a table and JSON (``--json``): for each run the limit, the step (s, the mean of the second
call's steps), the reads per step over the transformer's bytes, the disk time for those reads, step over
disk time, and **step / limit**: the step over the larger of the uncapped step and that disk time - no
step under a limit can be faster - and whether the image equals diffusers' (bit for bit).

Run: python benchmarks/capped_pipeline.py [--caps 6,10,50] [--blocks 16] [--steps 2] [--size 32]
     [--dir /var/tmp (the default)] [--json out.json]
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
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))  # cgroups.py; appended: shadows nothing

from capped_forward import (  # noqa: E402
    NO_LIMIT, _cg_oom_kills, _cg_peak, _cg_set_cap, _cg_usage, _parse_lines, _proc_io)

MIB = 1 << 20
MB = 1e6
GUIDANCE = 4.5
CAPTION = 64  # the caption's width (T5's d_model) and length
TOKENS = 16


def build(folder: str, blocks: int, heads: int, head_dim: int) -> None:
    """A PixArt-alpha pipeline of diffusers' own classes, random weights (seeded), saved to ``folder``."""
    import diffusers
    import torch
    import transformers as tf

    torch.manual_seed(0)
    transformer = diffusers.PixArtTransformer2DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8, num_layers=blocks,
        cross_attention_dim=heads * head_dim, sample_size=16, patch_size=2, caption_channels=CAPTION,
        norm_type="ada_norm_single", num_embeds_ada_norm=1000, use_additional_conditions=False)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64], layers_per_block=1,
        latent_channels=4, norm_num_groups=16)
    t5 = tf.T5EncoderModel(tf.T5Config(d_model=CAPTION, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
                                       vocab_size=100))
    pipe = diffusers.PixArtAlphaPipeline(tokenizer=None, text_encoder=t5, vae=vae, transformer=transformer,
                                         scheduler=diffusers.DPMSolverMultistepScheduler())
    pipe.save_pretrained(folder)


def _files(folder: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".safetensors"))


def _transformer_bytes(folder: str) -> int:
    return sum(os.path.getsize(p) for p in _files(os.path.join(folder, "transformer")))


def _timed_steps(transformer, row: dict):
    """Hooks on the transformer: each call's seconds and bytes read, appended to ``row``'s lists."""
    state: dict = {}

    def pre(module, args, kwargs):
        state["t0"], state["io0"] = time.perf_counter(), _proc_io()["read_bytes"]

    def post(module, args, kwargs, output):
        row["step_s"].append(time.perf_counter() - state["t0"])
        row["step_read_bytes"].append(_proc_io()["read_bytes"] - state["io0"])

    return (transformer.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
            transformer.register_forward_hook(post, with_kwargs=True))


def child(args: argparse.Namespace) -> None:
    if args.cgroup:
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    import diffusers
    import torch
    import transformers

    import mapoffload
    import mapoffload.hf.diffusers  # noqa: F401  (imported before the baseline: not the load's cost)
    from _common import AnonSampler
    from mapoffload.memory.budget import rss_anon_bytes

    transformers.logging.set_verbosity_error()
    diffusers.utils.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, TOKENS, CAPTION, generator=g)
    negative = torch.randn(1, TOKENS, CAPTION, generator=g)
    mask = torch.ones(1, TOKENS, dtype=torch.long)
    row: dict = {"contender": args.contender, "cap": args.cap, "threads": torch.get_num_threads(),
                 "loadavg_at_start": os.getloadavg()}
    if args.cgroup:
        row["cgroup_baseline"] = baseline = _cg_usage(args.cgroup)
        if args.extra is not None and baseline is None:
            raise OSError(f"cannot read the usage of {args.cgroup}: no limit can be set")
        if args.extra is not None:
            row["cgroup_cap"] = baseline + args.extra
            row["cgroup_cap_written"] = _cg_set_cap(args.cgroup, row["cgroup_cap"])
    row["anon_baseline"] = rss_anon_bytes()
    print("BASE " + json.dumps(row), flush=True)
    sampler = AnonSampler(rss_anon_bytes)
    sampler.start()
    t0 = time.perf_counter()
    if args.contender == "diffusers":
        pipe = diffusers.PixArtAlphaPipeline.from_pretrained(args.folder, tokenizer=None)
    else:
        pipe = mapoffload.pipeline_from_pretrained(diffusers.PixArtAlphaPipeline, args.folder, device="cpu",
                                                   tokenizer=None)
    row["load_s"] = time.perf_counter() - t0
    print("LOAD " + json.dumps(row), flush=True)
    row["step_s"], row["step_read_bytes"], row["call_s"] = [], [], []
    hooks = None
    for call in range(2):
        if call == 1:
            row["step_s"], row["step_read_bytes"] = [], []  # the warm-up's steps are not counted
            hooks = _timed_steps(pipe.transformer, row)
        t0 = time.perf_counter()
        with torch.inference_mode():
            image = pipe(prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt=None,
                         negative_prompt_embeds=negative,
                         negative_prompt_attention_mask=mask, guidance_scale=GUIDANCE, num_inference_steps=args.steps,
                         height=args.size, width=args.size, use_resolution_binning=False,
                         generator=torch.Generator().manual_seed(1),
                         output_type="pt").images
        row["call_s"].append(time.perf_counter() - t0)
    for h in hooks:
        h.remove()
    torch.save(image.clone(), args.out)
    handle = getattr(pipe, "mapoffload_handle", None)
    if handle is not None:
        row["summary"] = str(handle.summary()).splitlines()
        row["plans"] = {f"{c}.{name}": m.residency.describe() for c, h in handle.components.items()
                        for name, m in h.managers.items() if m.residency is not None}
        handle.close()
    row["anon_peak"] = sampler.stop()
    if args.cgroup:
        row["cgroup_peak"] = _cg_peak(args.cgroup)
    print("ROW " + json.dumps(row), flush=True)


def _drop(folder: str) -> bool:
    from _common import drop_caches

    return drop_caches(_files(folder))


def run(contender: str, cap: str, extra: int | None, folder: str, out: str, args: argparse.Namespace) -> dict:
    from cgroups import memory_cgroup

    cold = _drop(folder)
    if not cold:
        warnings.warn("cannot write /proc/sys/vm/drop_caches: only the pipeline's files are dropped", stacklevel=1)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--contender", contender, "--cap", cap,
           "--folder", folder, "--out", out, "--steps", str(args.steps), "--size", str(args.size)]
    if extra is not None:
        cmd += ["--extra", str(extra)]
    with memory_cgroup(NO_LIMIT) as cgroup:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd + ["--cgroup", cgroup], capture_output=True, text=True, timeout=args.timeout,
                                  cwd=tempfile.gettempdir())
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out, err = exc.stdout or "", exc.stderr or ""
            stdout = out.decode() if isinstance(out, bytes) else out
            stderr, rc = err.decode() if isinstance(err, bytes) else err, None
        kills = _cg_oom_kills(cgroup)
    if os.path.exists(cgroup):
        warnings.warn(f"could not remove the cgroup {cgroup}", stacklevel=1)
    row = _parse_lines(stdout)
    row.update(contender=contender, cap=cap, returncode=rc, cold=cold, wall_s=time.perf_counter() - t0,
               cgroup_oom_kills=kills, stderr_tail=stderr.strip().splitlines()[-3:])
    row["outcome"] = ("yes" if rc == 0 and row.get("step_s") else "timeout" if rc is None
                      else "OOM-killed" if rc == -9 or (kills or 0) > 0 else f"exit {rc}")
    if row["outcome"].startswith("exit"):
        print(f"{contender} ({cap}): exit {rc}\n{stderr[-4000:]}", file=sys.stderr)
    return row


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(results: list[dict], transformer: int, speed: float) -> list[list[str]]:
    """The rows; the limit of each capped run is the larger of the uncapped step and its disk time."""
    uncapped = next((_mean(r["step_s"]) for r in results
                     if r["contender"] == "mapoffload" and r["cap"] == "none" and r["outcome"] == "yes"), None)
    rows = []
    for r in results:
        if r["outcome"] != "yes":
            rows.append([r["contender"], r["cap"], r["outcome"]] + ["-"] * 7)
            continue
        step, read = _mean(r["step_s"]), _mean(r["step_read_bytes"])
        disk = read / speed
        limit = max(uncapped or 0.0, disk)
        r.update(step_s_mean=step, read_bytes_per_step=read, disk_s_per_step=disk,
                 step_over_limit=step / limit if r["cap"] != "none" and limit else None)
        limit_text = (f"{r['cgroup_cap'] / MIB:.0f} MiB" if "cgroup_cap" in r else "-")
        rows.append([r["contender"], r["cap"], "yes", limit_text, f"{step:.3f}", f"{read / transformer:.2f}",
                     f"{disk:.3f}", f"{step / disk:.2f}x" if disk > 0 else "-",
                     f"{r['step_over_limit']:.2f}x" if r["step_over_limit"] else "-",
                     "-" if r.get("image_equal") is None else "yes" if r["image_equal"] else "NO"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caps", default="6,10,50", help="comma list of percentages of the transformer's bytes")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--dir", default="/var/tmp", help="a folder on a disk (not tmpfs): the pipeline is written there")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json")
    for hidden in ("--child", "--contender", "--cap", "--folder", "--out", "--cgroup", "--extra"):
        p.add_argument(hidden, help=argparse.SUPPRESS, **({"action": "store_true"} if hidden == "--child" else {}))
    args = p.parse_args(argv)
    if args.child:
        args.extra = None if args.extra is None else int(args.extra)
        return child(args)
    import torch

    from _common import disk_read, emit_json, print_table

    work = os.path.abspath(tempfile.mkdtemp(prefix="mapoffload-pipeline-", dir=args.dir))
    try:
        folder = os.path.join(work, "pipeline")
        build(folder, args.blocks, args.heads, args.head_dim)
        transformer = _transformer_bytes(folder)
        speed = disk_read(_files(folder))["disk_gb_s"] * 1e9  # bytes a second
        print(f"transformer {transformer / MIB:.0f} MiB ({args.blocks} blocks); disk {speed / 1e9:.2f} GB/s")
        results = []
        ref = run("diffusers", "none", None, folder, os.path.join(work, "diffusers.pt"), args)
        results.append(ref)
        plain = run("mapoffload", "none", None, folder, os.path.join(work, "mapoffload-none.pt"), args)
        results.append(plain)
        growth = plain["anon_peak"] - plain["anon_baseline"] if plain["outcome"] == "yes" else None
        if growth is None:
            warnings.warn("the uncapped run failed: no capped run (their limits are set from it)", stacklevel=1)
        for cap in [c for c in args.caps.split(",") if c and growth is not None]:
            extra = growth + int(float(cap) / 100 * transformer)
            results.append(run("mapoffload", f"+{cap}%", extra, folder, os.path.join(work, f"mapoffload-{cap}.pt"),
                               args))
        want = torch.load(os.path.join(work, "diffusers.pt")) if ref["outcome"] == "yes" else None
        for r in results[1:]:
            out = os.path.join(work, f"mapoffload-{r['cap'].strip('+%') or 'none'}.pt")
            if want is not None and r["outcome"] == "yes" and os.path.exists(out):
                r["image_equal"] = bool(torch.equal(torch.load(out), want))
        print_table(["contender", "cap", "survived", "limit", "step s", "read/transformer", "disk s",
                     "step / disk", "step / limit", "image =="], table(results, transformer, speed))
        emit_json("capped_pipeline", {"blocks": args.blocks, "steps": args.steps,
                                      "size": args.size, "transformer_bytes": transformer, "disk_bytes_s": speed,
                                      "results": results}, args.json)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
