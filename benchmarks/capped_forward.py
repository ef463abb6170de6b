"""Bigger than RAM, at the speed of the disk (issue 12): a real transformers
model run under a memory cap below its size, transformers' ``from_pretrained``
against ``mapoffload.from_pretrained``.

Generates a Llama-style model from a ``transformers.LlamaConfig`` (default
hidden 1024, intermediate 3584, 24 layers, vocab 32000, float32: about 1.6 GiB
in 4 shards), random weights drawn with a fixed seed, saved with
``save_pretrained(max_shard_size="500MB")`` into a temporary folder under
``--dir`` (default /tmp; it must be a disk, not tmpfs; deleted afterwards
unless ``--keep``). Then, for every cap and contender, each in a fresh process
(this script with a hidden ``--child`` mode) started cold (``sync`` and
``echo 1 > /proc/sys/vm/drop_caches`` before it: checkpoint and libraries
alike come from the disk; where that is not permitted a warning, and only the
checkpoint files are dropped with ``mapoffload.drop_page_cache``):

  transformers  AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE), eval()
  mapoffload    mapoffload.from_pretrained(AutoModelForCausalLM, folder, device="cpu")
                (its layers streamed by the layerwise manager; the handle's
                summary() is in the JSON, handle.close() at the end;
                reads="auto": streamed layers read uncached
                (O_DIRECT) from the first forward that streams where
                the files take it, else through the mapping until two warm
                forwards read > 1.2x the plan - the JSON's read_mode says
                which)
  mapoffload-uncached  the same with reads="uncached" (O_DIRECT from the
                start; issue 18's tight caps)
  plain         the plain API (issue 25): the model built on meta (empty_weights,
                AutoModelForCausalLM.from_config), load_checkpoint(model, folder,
                keep_mapping=True), LayerwiseOffloadManager(model, "model.layers",
                device="cpu", prefetch_layers=1) with its default reads="auto",
                hooks registered
  plain-mapping (not run by default) the same with reads="mapping"
  twin-mapping, twin-uncached  (not run by default) the device pipeline's CPU
                twin over the layers (LayerwiseOffloadManager(cpu_twin=True,
                host_store="mapped")): each layer copied through the copier
                into CPU buffers, as a GPU run copies it - from the mapping,
                or read uncached into the reader's buffers and
                copied from them (reads="uncached"); the weights outside
                the layers stay in place on the mapping
  cuda-mapping, cuda-uncached  (not run by default; needs a GPU) the same load
                with device="cuda": layers streamed to the GPU through the
                copier from the mapping, or read uncached into
                page-locked reader buffers and copied from them by DMA
                (reads="uncached"); the rest on the GPU. The CUDA
                context is made before the baseline (its host memory is not
                the model's); forward time is synchronised; logits are
                compared by their max difference (GPU arithmetic differs)

Each child runs in a memory cgroup of its own (made by the parent under its own
cgroup, without a limit; v1 memory.limit_in_bytes or v2 memory.max). The child
joins it, does every import (torch, transformers, modeling_llama, mapoffload),
reads the cgroup's usage as its baseline and sets the cap

  none          no limit
  base+50%      baseline + 50 % of the checkpoint's bytes
  base+10%      baseline + 10 % of the checkpoint's bytes

(swap capped too: v1 memory.memsw.limit_in_bytes where present, v2
memory.swap.max = 0). The baseline is the cgroup's whole usage (with
``--baseline vmrss``: the process's VmRSS after the imports, issue 25's
setup, where the libraries' unmapped page cache is not part of the cap), so it holds
the page cache of the libraries the imports read (~180 MiB of ~440 MiB here;
``cgroup_baseline_file_cache`` in the JSON): under the cap that cache is
reclaimable, and the model gets up to that much more than its budget.

With --rooms 0.5,1,2 (issue 35) the limits are the room a user has instead: each
contender runs uncapped first, and each row's limit is that run's peak of anonymous
memory plus the room times the largest decoder layer (benchmarks/_rooms.py); the
column "room in layers" is what the run really had at its peak (its limit less its
own peak of anonymous memory, over the largest layer), the bound is the checkpoint
less that room, and --room-figure draws reads and seconds per forward against it.

Then the child loads (timed) and runs --forwards forwards of a fixed batch
(1 x --seq token ids, seed 0) under torch.inference_mode(). A child killed
by the OOM killer (signal 9, or oom_kill in memory.oom_control /
memory.events) is a result ("OOM-killed"), not a failure of the benchmark.

Columns:

  contender, cap      as above (the cap's MiB above the baseline in brackets)
  room in layers      the limit less the run's peak anonymous memory, over the
                      largest decoder layer (what the model's pages had at the peak)
  survived            yes / OOM-killed / timeout / exit N
  load s              wall seconds of the load call
  read MB/fwd         bytes this process read from the disk during a forward
                      (/proc/self/io read_bytes: counts mmap faults too), mean
                      of forwards 2..N (1e6 bytes per MB)
  read MB 1st fwd     the same for the first forward
  bound MB            checkpoint - budget, budget = cap - baseline: what must
                      come from the disk again in every forward when only the
                      budget can stay in memory (0 without a cap)
  read/bound          read MB/fwd over the bound
  read/ckpt           read MB/fwd over the checkpoint's bytes (issue 25: <= 1.1 when
                      nothing can stay cached)
  fwd s               mean wall seconds of forwards 2..N
  fwd / tf            over transformers' under the same cap in the same run
  disk s              read MB/fwd at the disk's sequential bandwidth (measured
                      once: the checkpoint dropped from the page cache, then
                      read with 8 MiB reads and, dropped again, mapped and
                      populated in 2 MiB folios; the faster: _common.disk_read)
  fwd / disk          fwd s over disk s (1.0: the forward runs at the speed of
                      the disk)
  fwd / limit         fwd s over the limit: the larger of the contender's own
                      uncapped forward and disk s (1.0: reads and compute
                      wholly overlapped; issue 43's goal is <= 1.2)
  cpu s (sys) / busy  a forward's CPU seconds over all our threads, the kernel's
                      share of them in brackets (reads, let-gos, faults), and
                      the seconds the machine's CPUs were busy meanwhile
                      (/proc/stat: kswapd and interrupts too); 2 cores give
                      at most 2 s a second
  peak RssAnon MiB    peak anonymous resident memory (/proc/self/status sampled
                      every 10 ms), its growth over the baseline in brackets
                      (the JSON splits it: anon_peak_load, anon_peak_forwards)
  logits ==           torch.equal of the last forward's logits with those of
                      the uncapped transformers run (which always runs: it is
                      the reference)

The JSON holds every raw number: per forward wall and CPU seconds (all
threads: a shared machine shows as wall >> CPU), read_bytes and major faults,
the load average at each child's start, the cgroup's baseline (and its page
cache), cap, peak (v1 memory.max_usage_in_bytes, v2 memory.peak) and OOM
counts, the disk bandwidth, the machine, the versions.
Skips (message, exit 0, JSON saying why) where memory cgroups cannot be made.

With --fp8 (issue 17) the model is generated in bfloat16 and also rewritten
in the fine-grained FP8 layout (every *_proj.weight as float8_e4m3fn codes with
[128, 128]-block weight_scale_inv; embeddings and head as they are), and the
contenders are

  transformers    from_pretrained of the fp8 folder: its dequantizing load (bf16)
  mapoffload      mapoffload.from_pretrained of the bf16 folder
  cuda-mapping    (not by default; needs a GPU) the bf16 folder streamed to the GPU
  cuda-fp8        (not by default; needs a GPU) the fp8 folder streamed to the GPU:
                  the copier moves codes and scales, the GPU dequantizes
  mapoffload-fp8  mapoffload.from_pretrained of the fp8 folder (codes stay mapped,
                  dequantized as each layer runs)

with caps as shares of the bf16 checkpoint; a second table gives the targets
(fp8 / bf16 reads and forward time at each cap, fp8's anonymous growth - the
load's peak and the forwards' - against two layers + 64 MiB, fp8 logits against transformers') and a figure of reads
and forward time against the cap is written (--figure; needs matplotlib:
pip install ".[bench]").

Run (as root, on a machine with cgroups): python benchmarks/capped_forward.py
     [--hidden 1024] [--intermediate 3584] [--layers 24] [--vocab 32000]
     [--dtype float32|bfloat16] [--tie] [--baseline cgroup|vmrss] [--seq 128] [--forwards 4] [--caps none,50,10]
     [--rooms 0.5,1,1.5,2,4 [--room-figure out.png]]
     [--contenders transformers,mapoffload] [--threads N] [--timeout 900]
     [--dir /a/disk/not/tmpfs] [--keep] [--json out.json] [--fp8 [--figure out.png]]
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

CONTENDERS = ("transformers", "mapoffload", "mapoffload-uncached", "mapoffload-fp8", "plain", "plain-mapping",
              "twin-mapping", "twin-uncached", "cuda-mapping", "cuda-uncached", "cuda-fp8")
FP8_PAIRS = (("mapoffload-fp8", "mapoffload"), ("cuda-fp8", "cuda-mapping"))  # --fp8: (fp8, its bf16 twin)
DEFAULT_CONTENDERS = CONTENDERS[:5]
MIB = 1 << 20
MB = 1e6
from _rooms import cap_fraction, figure as room_figure, largest_layer_bytes, parse_rooms, room_in_layers, room_of  # noqa: E402
NO_LIMIT = 1 << 62  # clamped by the kernel to "no limit" (v1 and v2 alike)


# --- cgroup files (v1 and v2) ------------------------------------------------------------------


def _cg_read_int(cgroup: str, *names: str) -> int | None:
    """The first of ``names`` that exists in the cgroup, as an int ("max": None)."""
    for name in names:
        try:
            with open(os.path.join(cgroup, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() else None
    return None


def _cg_write(cgroup: str, name: str, value: str) -> bool:
    try:
        with open(os.path.join(cgroup, name), "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _cg_is_v1(cgroup: str) -> bool:
    return os.path.exists(os.path.join(cgroup, "memory.limit_in_bytes"))


def _cg_usage(cgroup: str) -> int | None:
    return _cg_read_int(cgroup, "memory.usage_in_bytes", "memory.current")


def _cg_peak(cgroup: str) -> int | None:
    return _cg_read_int(cgroup, "memory.max_usage_in_bytes", "memory.peak")


def _cg_file_cache(cgroup: str) -> int | None:
    """Page cache charged to the cgroup (memory.stat: v1 total_cache, v2 file): reclaimable under the cap."""
    try:
        with open(os.path.join(cgroup, "memory.stat")) as f:
            stat = dict(line.split() for line in f)
    except OSError:
        return None
    value = stat.get("total_cache", stat.get("file"))
    return int(value) if value is not None else None


def _cg_oom_kills(cgroup: str) -> int | None:
    """oom_kill count of memory.oom_control (v1) or memory.events (v2)."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            with open(os.path.join(cgroup, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return None


def _cg_set_cap(cgroup: str, cap: int) -> dict:
    """Set the memory cap (and swap to nothing); says what was written."""
    if _cg_is_v1(cgroup):
        done = {"memory.limit_in_bytes": _cg_write(cgroup, "memory.limit_in_bytes", str(cap))}
        if os.path.exists(os.path.join(cgroup, "memory.memsw.limit_in_bytes")):
            done["memory.memsw.limit_in_bytes"] = _cg_write(cgroup, "memory.memsw.limit_in_bytes", str(cap))
    else:
        done = {"memory.max": _cg_write(cgroup, "memory.max", str(cap)),
                "memory.swap.max": _cg_write(cgroup, "memory.swap.max", "0")}
    if not done.get("memory.limit_in_bytes", done.get("memory.max")):
        raise OSError(f"cannot set the cap {cap} in {cgroup}")
    return done


# --- inside a fresh process --------------------------------------------------------------------


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _vmrss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def _machine_busy_s() -> float:
    """Seconds every CPU of the machine spent busy (``/proc/stat``: all but idle and iowait), this
    process's threads, the kernel's own (kswapd, interrupts) and any other work alike."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_cell(r: dict) -> str:
    """A forward's CPU seconds (all our threads), the kernel's share of them, and the machine's busy seconds
    (means over the forwards after the first; '-' for rows from before these were recorded)."""
    if not r.get("forward_sys_s"):
        return "-"
    return (f"{_mean_rest(r['forward_cpu_s']):.2f} ({_mean_rest(r['forward_sys_s']):.2f}) / "
            f"{_mean_rest(r['forward_machine_busy_s']):.2f}")


def _major_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])  # field 12, majflt


def child(args: argparse.Namespace) -> None:
    if args.cgroup:
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import mapoffload
    import mapoffload.hf.transformers  # noqa: F401  (imported before the baseline, as modeling_llama)
    import transformers.models.llama.modeling_llama  # noqa: F401  (lazy in transformers: not the load's cost)
    from _common import AnonSampler
    from mapoffload.memory.budget import rss_anon_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.contender.startswith("cuda-")
    if cuda:  # the context's host memory belongs to the baseline, not to the model
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    if cuda:
        ids = ids.cuda()

    row: dict = {"contender": args.contender, "cap": args.cap, "threads": torch.get_num_threads(),
                 "loadavg_at_start": os.getloadavg()}  # the machine may be shared: noise shows here
    if args.cgroup:
        row["cgroup_baseline"] = baseline = _cg_usage(args.cgroup)
        row["cgroup_baseline_file_cache"] = _cg_file_cache(args.cgroup)
        row["vmrss_baseline"] = _vmrss()
        if args.baseline == "vmrss":  # issue 25's setup: the libraries' unmapped page cache is not given
            baseline = row["vmrss_baseline"]
        if args.fraction is not None:
            if baseline is None:
                raise OSError(f"cannot read the usage of {args.cgroup}")
            row["cgroup_cap"] = cap = baseline + int(args.fraction * args.checkpoint_bytes)
            row["cgroup_cap_written"] = _cg_set_cap(args.cgroup, cap)
    row["anon_baseline"] = rss_anon_bytes()
    print("BASE " + json.dumps(row), flush=True)  # the parent keeps it if the child dies later
    sampler = AnonSampler(rss_anon_bytes)
    sampler.start()

    io0, t0 = _proc_io(), time.perf_counter()
    if args.contender == "transformers":  # on an fp8 folder: transformers' dequantizing load
        model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype)
        model.eval()
    elif args.contender == "mapoffload-uncached":  # streamed layers read uncached from the start
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device="cpu", reads="uncached")
    elif args.contender.startswith("twin-"):  # the device pipeline, its CPU twin, over the layers
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device="cpu", reads="mapping")
        model.mapoffload_handle.close()  # the model whole again, its weights on the mapping
        twin = mapoffload.LayerwiseOffloadManager(model, "model.layers", device="cpu", cpu_twin=True,
                                                  host_store="mapped", reads=args.contender[len("twin-"):])
        twin.register_forward_hooks()
    elif cuda:  # the device pipeline on a GPU, from the mapping or read uncached
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device="cuda",
                                           reads="auto" if args.contender == "cuda-fp8"
                                           else args.contender[len("cuda-"):])
    elif args.contender.startswith("plain"):  # the plain API: load_checkpoint + LayerwiseOffloadManager
        from transformers import AutoConfig

        with mapoffload.empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.folder), dtype=dtype)
        mapoffload.load_checkpoint(model, args.folder, keep_mapping=True)
        model.eval()
        plain = mapoffload.LayerwiseOffloadManager(
            model, "model.layers", device="cpu", prefetch_layers=1,
            reads="mapping" if args.contender == "plain-mapping" else "auto")
        plain.register_forward_hooks()
    else:
        model = mapoffload.from_pretrained(AutoModelForCausalLM, args.folder, device="cpu")
    row["load_s"] = time.perf_counter() - t0
    row["load_read_bytes"] = _proc_io()["read_bytes"] - io0["read_bytes"]
    row["anon_after_load"] = rss_anon_bytes()
    row["anon_peak_load"] = sampler.mark()  # the load's own peak; anon_peak_forwards: the forwards'
    report = getattr(model, "mapoffload_report", None)
    if report is not None:
        row["report_bytes_mapped"] = report.bytes_mapped
        row["report_bytes_copied"] = report.bytes_copied
        row["report_bytes_fp8"] = report.bytes_fp8
        row["report_bytes_converted"] = report.bytes_converted
    handle = None if args.contender.startswith("twin-") else getattr(model, "mapoffload_handle", None)
    if handle is not None:
        row["summary"] = str(handle.summary()).splitlines()
    print("LOAD " + json.dumps(row), flush=True)

    for key in ("forward_s", "forward_cpu_s", "forward_sys_s", "forward_machine_busy_s", "forward_read_bytes",
                "forward_major_faults"):
        row[key] = []
    row["forward_read_parts"] = _count_part_reads(model)  # where each forward's reads go (JSON only)
    with torch.inference_mode():
        for _ in range(args.forwards):
            io0, mf0, c0, t0 = _proc_io()["read_bytes"], _major_faults(), time.process_time(), time.perf_counter()
            sys0, busy0 = os.times().system, _machine_busy_s()
            logits = model(input_ids=ids).logits
            if cuda:
                torch.cuda.synchronize()
            row["forward_s"].append(time.perf_counter() - t0)
            row["forward_cpu_s"].append(time.process_time() - c0)  # all threads: tells waiting from computing
            row["forward_sys_s"].append(os.times().system - sys0)  # of it, in the kernel (reads, let-gos, faults)
            row["forward_machine_busy_s"].append(_machine_busy_s() - busy0)  # kswapd and interrupts too
            row["forward_read_bytes"].append(_proc_io()["read_bytes"] - io0)
            row["forward_major_faults"].append(_major_faults() - mf0)
    torch.save(logits.cpu().clone(), args.out)
    if handle is not None:
        from mapoffload.pagecache.coordinator import coordinator

        row["read_mode"] = {name: [m.parts.member.reads_mode, m.parts.member.reads_why] for name, m in handle.managers.items()}
        # The plan after the forwards (it may have changed: a cap hit gives the thin margin back).
        row["page_cache_after"] = coordinator().describe()
        row["thin_margin_failed"] = coordinator().thin_margin_failed
        row["plans_after"] = {name: m.residency.describe() for name, m in handle.managers.items()
                              if m.residency is not None}
        handle.close()
    if args.contender.startswith("twin-"):
        row["read_mode"] = {"model.layers": [twin.parts.member.reads_mode, twin.parts.member.reads_why]}
        row["twin_plan"] = twin.residency.describe()
        twin.close()
    if args.contender.startswith("plain"):
        from mapoffload.pagecache.coordinator import coordinator

        row["read_mode"] = {"model.layers": [plain.parts.member.reads_mode, plain.parts.member.reads_why]}
        row["page_cache_after"] = coordinator().describe()
        row["plans_after"] = {"model.layers": plain.residency.describe()}
        plain.close()
    row["anon_peak_forwards"] = sampler.stop()
    row["anon_peak"] = max(row["anon_peak_load"], row["anon_peak_forwards"])
    row["anon_samples"] = sampler.samples
    if args.cgroup:
        row["cgroup_peak"] = _cg_peak(args.cgroup)
    print("ROW " + json.dumps(row), flush=True)


def _count_part_reads(model) -> dict[str, list[int]]:
    """Bytes read (/proc/self/io) by the embedding lookup, the layers and the head, per forward."""
    layers = model.model.layers
    parts = {"embedding": (model.get_input_embeddings(),) * 2, "layers": (layers[0], layers[-1]),
             "head": (model.get_output_embeddings(),) * 2}
    reads: dict[str, list[int]] = {name: [] for name in parts}

    def counter(name: str, first, last) -> None:
        start = [0]

        def before(*_):
            start[0] = _proc_io()["read_bytes"]

        def after(*_):
            reads[name].append(_proc_io()["read_bytes"] - start[0])

        first.register_forward_pre_hook(before)
        last.register_forward_hook(after)

    for name, (first, last) in parts.items():
        counter(name, first, last)
    return reads


# --- the launcher ------------------------------------------------------------------------------


def _drop_caches(folder: str) -> bool:
    """sync + drop_caches; where not permitted, only the checkpoint files."""
    from _common import drop_caches
    from hf_load import _checkpoint_files

    return drop_caches(_checkpoint_files(folder))


def disk_bandwidth(folder: str) -> dict:
    """Sequential read of every checkpoint file, dropped from the page cache first."""
    from _common import disk_read
    from hf_load import _checkpoint_files

    return disk_read(_checkpoint_files(folder))


def _parse_lines(stdout: str) -> dict:
    row: dict = {}
    for tag in ("BASE ", "LOAD ", "ROW "):
        for line in stdout.splitlines():
            if line.startswith(tag):
                row.update(json.loads(line[len(tag):]))
    return row


def run(contender: str, cap: str, folder: str, out: str, sizes: dict, args: argparse.Namespace) -> dict:
    from cgroups import memory_cgroup

    cold = _drop_caches(folder)
    if not cold and not args.warned_drop:
        warnings.warn("cannot write /proc/sys/vm/drop_caches: only the checkpoint files are dropped", stacklevel=1)
        args.warned_drop = True
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--contender", contender, "--cap", cap,
           "--folder", folder, "--out", out, "--dtype", args.dtype, "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--forwards", str(args.forwards), "--threads", str(args.threads),
           "--checkpoint-bytes", str(sizes["checkpoint_bytes"]), "--baseline", args.baseline]
    room = room_of(cap)
    if room is not None:  # the contender's own uncapped peak of anonymous memory plus the room
        calibration = args.calibration.get(contender)
        if calibration is None:
            return {"contender": contender, "cap": cap, "outcome": "no uncapped run", "wall_s": 0.0}
        cmd += ["--fraction", str(cap_fraction(calibration, room, args.layer_bytes, sizes["checkpoint_bytes"]))]
    elif cap != "none":
        cmd += ["--fraction", str(int(cap) / 100)]
    with memory_cgroup(NO_LIMIT) as cgroup:
        cmd += ["--cgroup", cgroup]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=tempfile.gettempdir())
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:  # run() has killed it
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            rc = None
        wall = time.perf_counter() - t0
        oom_kills = _cg_oom_kills(cgroup)
        parent_peak = _cg_peak(cgroup)
    if os.path.exists(cgroup):
        warnings.warn(f"could not remove the cgroup {cgroup}", stacklevel=1)
    row = _parse_lines(stdout)
    row.update(contender=contender, cap=cap, returncode=rc, wall_s=wall, cold=cold, cgroup_oom_kills=oom_kills,
               cgroup_peak_after=parent_peak, stderr_tail=stderr.strip().splitlines()[-3:])
    if rc == 0 and "forward_s" in row:
        row["outcome"] = "yes"
    elif rc is None:
        row["outcome"] = "timeout"
    elif rc == -9 or (oom_kills or 0) > 0:
        row["outcome"] = "OOM-killed"
    else:
        row["outcome"] = f"exit {rc}"
        if not row.get("forward_s"):  # a crash, not a cap: the benchmark is broken
            print(f"{contender} (cap {cap}): exit {rc}\n{stderr[-4000:]}", file=sys.stderr)
    return row


def _mean_rest(values: list[float]) -> float | None:
    """Mean of all but the first (the first alone where there is one)."""
    rest = values[1:] or values[:1]
    return sum(rest) / len(rest) if rest else None


def summarise(r: dict, sizes: dict, disk_gb_s: float, tf_fwd: float | None, own_fwd: float | None = None) -> list[str]:
    """One table row from a result. The cap is a share of ``sizes["checkpoint_bytes"]``
    (with --fp8: the bf16 checkpoint's); the bound is what the contender's own
    checkpoint (``r["folder_bytes"]``) cannot keep in that budget. ``own_fwd``: the
    contender's uncapped forward, for the limit (the larger of it and the disk time
    for what this run read: no forward under a cap can be faster)."""
    ckpt = sizes["checkpoint_bytes"]
    if room_of(r["cap"]) is not None:
        # What the model may keep in memory: the limit less this run's peak of anonymous memory.
        budget = max(0, r["cgroup_cap"] - r["anon_peak"]) if "cgroup_cap" in r and "anon_peak" in r else None
        cap = f"room {room_of(r['cap']):g} (limit {r['cgroup_cap'] / MIB:.0f} MiB)" if budget is not None else r["cap"]
    else:
        budget = int(int(r["cap"]) / 100 * ckpt) if r["cap"] != "none" else None
        cap = "none" if budget is None else f"base+{r['cap']}% ({budget / MIB:.0f} MiB)"
    room = room_in_layers(r, sizes["layer_bytes"])
    room = "-" if room is None else f"{room:.2f}"
    bound = max(0, r.get("folder_bytes", ckpt) - budget) if budget is not None else 0
    r["budget_bytes"], r["bound_bytes"] = budget, bound
    na = "-"
    if r["outcome"] != "yes":
        return [r["contender"], cap, room, r["outcome"], f"{r['load_s']:.2f}" if "load_s" in r else na,
                na, na, f"{bound / MB:.0f}", na, na, na, na, na, na, na, na,
                f"{r['anon_peak'] / MIB:.0f}" if "anon_peak" in r else na, na]
    read = _mean_rest(r["forward_read_bytes"])
    fwd = _mean_rest(r["forward_s"])
    disk_s = read / (disk_gb_s * 1e9)
    r["read_bytes_per_forward"], r["forward_s_mean"], r["disk_s_per_forward"] = read, fwd, disk_s
    limit = max(own_fwd or 0.0, disk_s)
    r["forward_over_limit"] = fwd / limit if limit > 0 else None
    return [
        r["contender"], cap, room, "yes", f"{r['load_s']:.2f}", f"{read / MB:.0f}", f"{r['forward_read_bytes'][0] / MB:.0f}",
        f"{bound / MB:.0f}", f"{read / bound:.2f}" if bound else na, f"{read / r.get('folder_bytes', ckpt):.2f}",
        f"{fwd:.3f}",
        f"{fwd / tf_fwd:.2f}x" if tf_fwd else na, f"{disk_s:.3f}", f"{fwd / disk_s:.2f}x" if disk_s > 0 else na,
        f"{r['forward_over_limit']:.2f}x" if r["forward_over_limit"] and r["cap"] != "none" else na,
        _cpu_cell(r),
        f"{r['anon_peak'] / MIB:.0f} (+{(r['anon_peak'] - r['anon_baseline']) / MIB:.0f})",
        "-" if r.get("logits_equal") is None else "yes" if r["logits_equal"] else "NO",
    ]


def _fp8_targets(results: list[dict], sizes: dict, args: argparse.Namespace) -> None:
    """fp8 against bf16 mapoffload at each cap (issue 17's targets), and the figure."""
    from _common import print_table
    from _fp8 import figure

    by = {(r["contender"], r["cap"]): r for r in results if r["outcome"] == "yes"}
    layer = sizes["weight_bytes"] / max(args.layers, 1)  # a rough layer in bf16 (embeddings included)
    rows = []
    pairs = [(cap, fp8, bf16) for cap in dict.fromkeys(r["cap"] for r in results) for fp8, bf16 in FP8_PAIRS]
    for cap, fp8_name, bf16_name in pairs:
        a, b = by.get((fp8_name, cap)), by.get((bf16_name, cap))
        if not (a and b):
            continue
        load = a.get("anon_peak_load", a["anon_peak"]) - a["anon_baseline"]
        fwd = a.get("anon_peak_forwards", a["anon_peak"]) - a["anon_baseline"]
        rows.append([f"{fp8_name} / {bf16_name}", cap, f"{a['read_bytes_per_forward'] / max(b['read_bytes_per_forward'], 1):.2f}",
                     f"{a['forward_s_mean'] / b['forward_s_mean']:.2f}", f"{load / MIB:.0f} / {fwd / MIB:.0f}",
                     f"{(2 * layer + 64 * MIB) / MIB:.0f}", f"{a.get('logits_max_abs_diff', float('nan')):.3g}"])
    print()
    print_table(["pair", "cap", "fp8 / bf16 read per fwd (<= 0.55)", "fp8 / bf16 fwd s (<= 0.65 at 50)",
                 "fp8 anon growth MiB (load / forwards)", "2 layers + 64 MiB", "fp8 logits vs transformers"], rows)
    made = figure(results, args.figure)
    print(f"figure: {made}" if made else "figure: matplotlib is not installed (pip install matplotlib)")


def _skip(reason: str, args: argparse.Namespace) -> int:
    from _common import emit_json

    print(f"skipped: {reason}")
    emit_json("capped_forward", {"skipped": reason}, args.json)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 64)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = heads)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tie", action="store_true", help="tie the head to the embedding (tie_word_embeddings)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--forwards", type=int, default=4)
    ap.add_argument("--caps", default="none,50,10",
                    help="comma list: none, or a percentage of the checkpoint's bytes above the baseline")
    ap.add_argument("--rooms", default=None,
                    help="comma list of rooms in layers (0.5,1,1.5,2,4): instead of --caps, each contender's limit is "
                         "its own uncapped peak of anonymous memory plus that many of the largest layer")
    ap.add_argument("--peak-growth-mib", type=float, default=None,
                    help="with --rooms: each contender's uncapped peak taken as its anonymous memory after the "
                         "imports plus this many MiB instead of as measured (it moves by 30 MiB between runs), so "
                         "that two trees run back to back compare at the same limits")
    ap.add_argument("--room-figure", default="capped_forward_rooms.png",
                    help="with --rooms: the figure of reads and seconds per forward against the room (matplotlib)")
    ap.add_argument("--baseline", choices=("cgroup", "vmrss"), default="cgroup",
                    help="what the caps are above: the cgroup's usage after the imports (the libraries' page "
                         "cache included) or the process's VmRSS then (issue 25's setup: that cache is not given)")
    ap.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                    help="which to run (transformers without a cap always runs: its logits are the reference)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child")
    ap.add_argument("--dir", default="/tmp", help="where to write the model (a disk, not tmpfs)")
    ap.add_argument("--keep", action="store_true", help="keep the model folder and logits")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    ap.add_argument("--fp8", action="store_true",
                    help="bf16 and fine-grained FP8 copies of the model: transformers (its dequantizing load of "
                         "the fp8 folder), mapoffload on the bf16 folder, mapoffload-fp8 on the fp8 folder; caps "
                         "are shares of the bf16 checkpoint")
    ap.add_argument("--figure", default="capped_forward_fp8.png",
                    help="with --fp8: where the figure goes (needs matplotlib; default: %(default)s)")
    # inside a fresh process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--cap", help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.fp8:
        args.dtype = "bfloat16"
    args.heads = args.heads or max(1, args.hidden // 64)
    args.kv_heads = args.kv_heads or args.heads
    args.warned_drop = False
    chosen = [c for c in args.contenders.split(",") if c]
    if bad := [c for c in chosen if c not in CONTENDERS]:
        ap.error(f"unknown contenders {bad}; choose from {CONTENDERS}")
    caps = list(dict.fromkeys(c.strip() for c in args.caps.split(",") if c.strip()))
    if bad := [c for c in caps if c != "none" and not (c.isdigit() and 0 < int(c) <= 1000)]:
        ap.error(f"bad caps {bad}: none or a percentage")
    if args.rooms:
        try:
            caps = ["none", *parse_rooms(args.rooms)]  # each contender's uncapped run calibrates its rooms
        except ValueError as exc:
            ap.error(str(exc))
    if not args.fp8:
        chosen = [c for c in chosen if c not in ("mapoffload-fp8", "cuda-fp8")]
    else:
        chosen = [c for c in chosen if c not in ("mapoffload-uncached", "cuda-uncached") and not c.startswith("twin-")]
    plan = [(c, k) for k in caps for c in CONTENDERS if c in chosen]
    if ("transformers", "none") not in plan:
        plan.insert(0, ("transformers", "none"))

    from _common import emit_json, machine, print_table

    try:
        from cgroups import memory_cgroup

        with memory_cgroup(NO_LIMIT):
            pass
    except OSError as exc:
        return _skip(str(exc), args)

    import torch

    from hf_load import _version, generate

    print(f"machine: {machine()}")
    work = tempfile.mkdtemp(prefix="mapoffload-capped-", dir=args.dir)
    try:
        folder = os.path.join(work, "model")
        sizes = generate(folder, args)
        print(f"model: Llama-style, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
              f"vocab {args.vocab}{' tied' if args.tie else ''}, {args.dtype}: {sizes['params'] / 1e6:.1f} M parameters, "
              f"{sizes['checkpoint_bytes'] / MIB:.1f} MiB in {sizes['shards']} shard(s), "
              f"generated in {sizes['generate_s']:.1f} s")
        folders = {c: folder for c in CONTENDERS}
        folder_bytes = {c: sizes["checkpoint_bytes"] for c in CONTENDERS}
        if args.fp8:
            from _fp8 import quantize_folder

            fp8 = quantize_folder(folder, os.path.join(work, "model-fp8"))
            for name in ("transformers", "mapoffload-fp8", "cuda-fp8"):
                folders[name] = os.path.join(work, "model-fp8")
                folder_bytes[name] = fp8["checkpoint_bytes"]
            sizes["fp8_checkpoint_bytes"] = fp8["checkpoint_bytes"]
            print(f"fp8: the same model in the fine-grained FP8 layout, {fp8['checkpoint_bytes'] / MIB:.1f} MiB "
                  f"({fp8['checkpoint_bytes'] / sizes['checkpoint_bytes']:.2f} x the bf16 checkpoint); "
                  "transformers loads it (dequantizing), caps are shares of the bf16 checkpoint")
        sizes["layer_bytes"] = args.layer_bytes = largest_layer_bytes(folder)
        args.calibration = {}
        disk = disk_bandwidth(folder)
        print(f"disk: {disk['disk_gb_s']:.2f} GB/s sequential ({disk['disk_bytes'] / MIB:.0f} MiB, cold; the faster of "
              f"8 MiB reads, {disk['disk_gb_s_read']:.2f}, and mapped in 2 MiB folios, {disk['disk_gb_s_mapped'] or 0:.2f})")
        results, logits = [], {}
        for contender, cap in plan:
            out = os.path.join(work, f"logits-{contender}-{cap}.pt")
            r = run(contender, cap, folders[contender], out, sizes, args)
            r["folder_bytes"] = folder_bytes[contender]
            print(f"  {contender:12} cap {cap:5}: {r['outcome']} in {r['wall_s']:.1f} s", flush=True)
            results.append(r)
            if cap == "none" and r["outcome"] == "yes" and "cgroup_baseline" in r:
                peak = (r["anon_peak"] if args.peak_growth_mib is None
                        else r["anon_baseline"] + int(args.peak_growth_mib * MIB))
                args.calibration[contender] = {"anon_peak": peak, "cgroup_baseline": r["cgroup_baseline"]}
            if r["outcome"] == "yes":
                logits[(contender, cap)] = torch.load(out)
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ref = logits.get(("transformers", "none"))
    for r in results:
        got = logits.get((r["contender"], r["cap"]))
        same_model = not args.fp8 or r["contender"] not in ("mapoffload", "cuda-mapping")  # --fp8: bf16 is another model
        r["logits_equal"] = None if got is None or ref is None or not same_model else torch.equal(got, ref)
        if got is not None and ref is not None:
            r["logits_max_abs_diff"] = (got.float() - ref.float()).abs().max().item()

    tf_fwd = {r["cap"]: _mean_rest(r["forward_s"]) for r in results
              if r["contender"] == "transformers" and r["outcome"] == "yes"}
    own_fwd = {r["contender"]: _mean_rest(r["forward_s"]) for r in results if r["cap"] == "none" and r["outcome"] == "yes"}
    rows = [summarise(r, sizes, disk["disk_gb_s"], tf_fwd.get(r["cap"]), own_fwd.get(r["contender"])) for r in results]
    print()
    print_table(["contender", "cap", "room in layers", "survived", "load s", "read MB/fwd", "read MB 1st fwd", "bound MB",
                 "read/bound", "read/ckpt", "fwd s", "fwd / tf", "disk s", "fwd / disk", "fwd / limit", "cpu s (sys) / busy",
                 "peak RssAnon MiB", "logits =="], rows)
    if args.fp8:
        _fp8_targets(results, sizes, args)
    if args.rooms:
        made = room_figure(results, sizes["layer_bytes"], sizes["checkpoint_bytes"], args.room_figure)
        print(f"figure: {made}" if made else "figure: matplotlib is not installed (pip install matplotlib)")
    emit_json("capped_forward", {
        "dtype": args.dtype, "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
        "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "tie": args.tie, "seq": args.seq,
        "forwards": args.forwards, "caps": caps, "baseline": args.baseline, "threads": args.threads or None, "timeout_s": args.timeout,
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": _version("transformers"),
        "mapoffload": _version("mapoffload"), **sizes, **disk, "results": results,
    }, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
