"""`mapoffload demo`: the whole library on a synthetic checkpoint, on any machine.

Builds a transformer-like checkpoint in a temporary folder, makes the host
budget smaller than it (as ``MAPOFFLOAD_HOST_AVAILABLE_GIB`` would), loads it
with ``load_checkpoint`` under ``empty_weights()`` (the gate decides), runs the
layerwise offload manager on the best device present, checks the output
against a reference computed without offload, and reports. It says which
mode runs: CUDA, in place on the CPU (the default there: nothing is copied),
or the device pipeline's CPU twin (``--cpu-twin``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from .._log import format_bytes
from ..memory.budget import (ENV_HOST_AVAILABLE_GIB, GIB_BYTES, HOST_COPY_RESERVE_BYTES, MAX_HOST_GIB,
                            rss_anon_bytes)
from .demo_sizing import _block_bytes, _check_budget, _check_room, _demo_folder, model_class, write_checkpoint
from .demo_steps import copy_layers, library_buffers, step_rows, time_steps

if TYPE_CHECKING:
    import torch

__all__ = ["DemoConfig", "resolve_device", "run_demo"]


@dataclass
class DemoConfig:
    layers: int = 8
    width: int = 1024
    tokens: int = 256
    steps: int = 3
    device: str | None = None  # None: cuda if present, else cpu
    host_gib: float | None = None  # None: half the checkpoint
    cpu_twin: bool = False  # on the CPU: the device pipeline's twin instead of computing in place


def _mode(device, cpu_twin: bool) -> tuple[str, str]:
    """(short name, one line saying what runs) for the device and ``cpu_twin``."""
    if device.type == "cuda":
        return "cuda", (f"CUDA ({device}): each layer copied from the file mapping through pinned staging slots "
                        "to the device, one layer ahead of the compute")
    if cpu_twin:
        return "cpu twin", ("CPU twin of the device pipeline: each layer copied through the copier into separate "
                            "CPU buffers, as a GPU run copies it (those buffers are host memory here)")
    return "in place", ("in place on the CPU: layers compute where the load left them (the file mapping, unless "
                        "copies fit and the gate copies); no copy of the weights is kept to run them, but the "
                        "layers the page-cache plan streams may be read from the file into reused uncached "
                        "buffers (anonymous memory: the growth the report shows)")


def resolve_device(name: str | None):
    """The ``torch.device`` the demo runs on (None: cuda if present, else cpu).

    The rule is :func:`mapoffload._checks.check_device`'s, the one the Python
    entry points apply, worded for ``--device``.

    Raises
    ------
    ValueError
        One line, before anything is written: not a device, a device the demo
        does not run on, or CUDA asked for where torch sees none (torch itself
        would fail at the first tensor with an ``AssertionError``) or a CUDA
        index it does not see.
    """
    import torch

    from .._checks import check_device

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(name, flag="--device", program="the demo")


def _warm_up(Model, folder: str, device, cpu_twin: bool, copies: bool) -> None:
    """One forward of a one-layer model through the same pipeline, before the baseline.

    A process pays once for the library's first use, whatever the model:
    the library's own modules, the worker threads' stacks and malloc arenas
    (which glibc keeps for the threads that follow).
    The demo measures it here and says it, apart from the budget.
    """
    import torch
    from safetensors.torch import save_file

    from ..loading.checkpoint import empty_weights, load_checkpoint
    from ..copier import Copier
    from ..offload import LayerwiseOffloadManager

    path = os.path.join(folder, "warm-up.safetensors")
    tiny = Model(1, 64)
    save_file({f"blocks.0.{n}": p.detach().contiguous() for n, p in tiny.blocks[0].named_parameters()}, path)
    with empty_weights():
        model = Model(1, 64)
    model.scale = model.scale.to(device)
    load_checkpoint(model, path)
    copier = Copier(device) if copies else None
    try:
        with LayerwiseOffloadManager(model, "blocks", device=device, copier=copier, cpu_twin=cpu_twin) as mgr:
            mgr.register_forward_hooks()
            with torch.inference_mode():
                model(torch.zeros(4, 64, device=device))
    finally:
        if copier is not None:
            copier.close()
    del model
    os.remove(path)


def _held_anon_bytes() -> int:
    """RssAnon once the allocator gave its freed memory back (glibc keeps freed
    blocks, activations' among them, after its mmap threshold grew)."""
    from ..memory.budget import release_freed_memory

    release_freed_memory()
    return rss_anon_bytes()


def _judge_gate(kept: bool, keep: bool, size: int, available: int, say) -> list[str]:
    """Step 3: what the gate did (``kept``: the checkpoint left on the mapping), said and judged
    against its rule (``keep``: what ``host_copies_would_not_fit`` answers with ``available``, the
    host budget as the gate sees it: :func:`_as_if_host_gib`); returns the failures.

    The line it says is in terms of the host budget step 1 stated, not a second figure; a failure
    gives the bytes the rule was asked with."""
    reserve = f"less the {format_bytes(HOST_COPY_RESERVE_BYTES)} reserve"
    room = available - HOST_COPY_RESERVE_BYTES
    if room <= 0:  # the budget less the reserve is no amount of room: say so, not a negative number
        why = (f"the host budget is smaller than the {format_bytes(HOST_COPY_RESERVE_BYTES)} reserve the gate "
               f"keeps for the rest of the process: no room for {format_bytes(size)} of copies")
    else:
        why = (f"{format_bytes(size)} {'is more than' if kept else 'within'} the {format_bytes(room)} the host "
               f"budget leaves {reserve}")
    if kept:
        say(f"      the gate kept the checkpoint on the file mapping: host copies would not fit ({why})")
    else:
        say(f"      the gate copied the checkpoint into host memory: host copies fit ({why})")
    against = f"{format_bytes(size)} against {format_bytes(available)} of host budget available {reserve}"
    if kept and not keep:
        return [f"the gate kept the checkpoint mapped where host copies fit ({against})"]
    if not kept and keep:
        return [f"the gate copied a checkpoint whose host copies would not fit ({against})"]
    return []


def _as_if_host_gib(budget: int) -> str:
    """``MAPOFFLOAD_HOST_AVAILABLE_GIB`` for a run that may take ``budget`` bytes of host memory.

    The variable describes a host of X GiB on which the process's own
    anonymous memory (``RssAnon``) is in use, so the gate and the page-cache
    plan see ``X GiB - RssAnon`` available. The demo's budget is what the
    load and the forwards may add to the process: X is the budget above the
    process's anonymous memory now (the allocator's freed memory given back
    first), so that what the library sees available is the budget, the figure
    the demo states and holds its growth to.
    """
    from ..memory import budget as host

    host.release_freed_memory()
    return repr(min((budget + host.rss_anon_bytes()) / GIB_BYTES, float(MAX_HOST_GIB)))


@dataclass
class _Setup:
    """What the run is, settled before anything is written."""

    device: torch.device
    mode: str
    mode_line: str
    copies: bool  # the layers go through the copier (not in place)
    Model: type
    folder: str


@dataclass
class _Written:
    """Steps 1 and 2: the checkpoint, its budget, the reference's output and step times."""

    path: str
    size: int
    budget: int
    x: torch.Tensor
    expected: torch.Tensor
    t_ref: list[float]


@dataclass
class _Loaded:
    """Step 3: the model loaded, with the baselines the checks measure against."""

    model: torch.nn.Module
    report: object
    first_use: int
    anon0: int
    hosts: list
    cow0: int


@dataclass
class _Offloaded:
    """Step 4: what the offloaded run measured."""

    same: bool
    turned: int
    anon: int
    parts: str
    mapped: int
    plan: object
    per_layer: list[float]
    copy_s: float
    t_off: list[float]


def _setup(cfg: DemoConfig) -> _Setup:
    """The device, the mode and the checks that refuse a run before anything is written."""
    device = resolve_device(cfg.device)
    if cfg.cpu_twin and device.type != "cpu":
        raise ValueError(f"--cpu-twin runs the device pipeline on the CPU; it does not apply to {device}")
    mode, mode_line = _mode(device, cfg.cpu_twin)
    if cfg.host_gib is not None and not 0 < cfg.host_gib <= MAX_HOST_GIB:
        raise ValueError(f"host_gib must be a positive number of GiB, at most {MAX_HOST_GIB}, not {cfg.host_gib!r}")
    Model = model_class()
    layer_bytes, layer_tensors = _block_bytes(Model, cfg.width)
    folder = _demo_folder()
    _check_room(cfg, device, layer_bytes, folder)
    _check_budget(cfg, mode, layer_bytes, layer_tensors, Model)
    return _Setup(device, mode, mode_line, mode != "in place", Model, folder)


def _write_and_reference(cfg: DemoConfig, run: _Setup, tmp: str, say) -> _Written:
    """Steps 1 and 2: the checkpoint written, the host budget stated, the reference output and its step times."""
    import torch

    from ..loading.checkpoint import checkpoint_bytes

    path = os.path.join(tmp, "model.safetensors")
    say(f"[1/5] writing a {cfg.layers}-layer, width-{cfg.width} checkpoint to {path}")
    ref = write_checkpoint(run.Model, cfg, path, say)
    size = checkpoint_bytes(path)
    host_gib = cfg.host_gib if cfg.host_gib is not None else size / 2 / (1 << 30)
    budget = int(host_gib * (1 << 30))
    say(f"      {format_bytes(size)} on disk; host budget {format_bytes(budget)} "
        f"({'--host-gib' if cfg.host_gib is not None else 'half the checkpoint'}): what the load and the "
        "forwards may add to the process's memory, which the gate and the page cache see as available "
        f"({ENV_HOST_AVAILABLE_GIB} set to it above what the process holds) and the most its anonymous memory "
        "may grow")

    say("[2/5] reference output without offload")
    x = torch.randn(cfg.tokens, cfg.width, device=run.device)
    ref.to(run.device)
    with torch.inference_mode():
        expected = ref(x)
        t_ref = time_steps(lambda: ref(x), cfg.steps, run.device)
    return _Written(path, size, budget, x, expected, t_ref)


def _load(cfg: DemoConfig, run: _Setup, w: _Written, tmp: str, say, failures: list[str]) -> _Loaded:
    """Step 3: the warm-up, the baseline, and ``load_checkpoint`` under ``empty_weights()``, the gate deciding
    (its answer judged against its rule into ``failures``)."""
    from ..memory.budget import host_copies_would_not_fit, host_memory_available_bytes
    from ..loading.checkpoint import empty_weights, load_checkpoint
    from ..memory.regions import cow_report

    say("[3/5] load_checkpoint under empty_weights(), the gate deciding")
    before = _held_anon_bytes()
    _warm_up(run.Model, tmp, run.device, cfg.cpu_twin, run.copies)
    first_use = _held_anon_bytes() - before
    say(f"      first use of the library, measured on a one-layer warm-up and not counted in the budget: "
        f"{format_bytes(first_use)} (the library's modules; "
        "worker threads' stacks and arenas)")
    with empty_weights():
        model = run.Model(cfg.layers, cfg.width)
    model.scale = model.scale.to(run.device)
    anon0 = _held_anon_bytes()
    os.environ[ENV_HOST_AVAILABLE_GIB] = _as_if_host_gib(w.budget)  # the budget above this baseline
    # The gate's rule, asked here with the same bytes and budget: the check judges
    # the loader's answer against it (copies that fit are the right answer too).
    available = host_memory_available_bytes()
    keep = host_copies_would_not_fit(w.size, available_bytes=available)
    report = load_checkpoint(model, w.path)
    say(f"      {report}")
    failures += _judge_gate(report.keep_mapping, keep, w.size, available, say)
    hosts = list(model.parameters())
    return _Loaded(model, report, first_use, anon0, hosts, cow_report(hosts).anonymous_bytes)


def _offload(cfg: DemoConfig, run: _Setup, w: _Written, ld: _Loaded, say, failures: list[str]) -> _Offloaded:
    """Step 4: the layerwise offload run and checked (output, copy-on-write, anonymous growth) into
    ``failures``; the manager and copier closed."""
    import torch

    from ..copier import Copier
    from ..offload import LayerwiseOffloadManager
    from ..memory.regions import cow_report

    device, model = run.device, ld.model
    say(f"[4/5] layerwise offload, {run.mode}")
    copier = Copier(device) if run.copies else None
    mgr = LayerwiseOffloadManager(model, "blocks", device=device, prefetch_layers=1, copier=copier,
                                  cpu_twin=cfg.cpu_twin)
    per_layer = copy_layers(mgr, cfg.layers, device, run.copies, ld.report.keep_mapping, say)
    mgr.register_forward_hooks()
    with torch.inference_mode():
        got = model(w.x)
        t_off = time_steps(lambda: model(w.x), cfg.steps, device)
    same = torch.equal(got, w.expected) if device.type == "cpu" else torch.allclose(got, w.expected, 1e-4, 1e-5)
    del got
    if not same:
        failures.append("offloaded output differs from the reference")
    turned = cow_report(ld.hosts).anonymous_bytes - ld.cow0
    if turned:
        failures.append(f"{turned} bytes of the mapping turned anonymous")
    anon = _held_anon_bytes() - ld.anon0
    if run.mode == "cpu twin":
        # The twin's layer buffers are host memory by construction. Count them even
        # when the allocator served them from memory freed earlier (the reference
        # model's), which leaves the RSS delta near zero.
        anon = max(anon, mgr.peak_device_bytes)
    parts = library_buffers(mgr, copier, run.mode, ld.report)
    if anon > w.budget:
        failures.append(
            f"anonymous memory grew by {format_bytes(anon)}, over the {format_bytes(w.budget)} host budget "
            f"({parts})"
        )
    copy_s = sum(mgr.parts.layer_bytes(i) / (gbps * 1e9) for i, gbps in enumerate(per_layer))
    done = _Offloaded(same, turned, anon, parts, mgr.mapped_bytes, mgr.residency, per_layer, copy_s, t_off)
    mgr.close()
    if copier is not None:
        copier.close()
    return done


def _report_rows(run: _Setup, w: _Written, ld: _Loaded, o: _Offloaded) -> list[tuple[str, str]]:
    """Step 5's rows."""
    size, budget = w.size, w.budget
    return [
        ("mode", run.mode_line.split(":")[0]),
        ("checkpoint bytes", f"{size} ({format_bytes(size)})"),
        ("left on the file mapping", f"{o.mapped} ({format_bytes(o.mapped)})"),
        ("host anonymous growth", f"{format_bytes(o.anon)} ({100 * o.anon / budget:.1f} % of the host budget), "
                                  f"held after the forwards; {o.parts}"),
        ("first use (per process)", f"{format_bytes(ld.first_use)} (not in the budget)"),
        ("mapping turned anonymous", f"{o.turned} bytes"),
        ("copy bandwidth per layer",
         f"{min(o.per_layer):.2f}-{max(o.per_layer):.2f} GB/s" if o.per_layer
         else "none: nothing is copied in place"),
        *step_rows(o.t_off, w.t_ref, run.mode, o.plan, o.copy_s, ld.report.keep_mapping),
        ("output check", "identical to the reference" if o.same else "MISMATCH"),
    ]


def run_demo(cfg: DemoConfig, out: TextIO | None = None) -> int:
    """Run the demo; return the process exit code (0 when every check passed).

    The checks: the gate answers as its rule does (``host_copies_would_not_fit``
    under the demo's budget: mapped when copies would not fit, copied when they
    fit), the offloaded output is the reference's, no mapped page turned
    anonymous, and the anonymous memory the process holds after the forwards
    grew by no more than the host budget the demo set. The budget is one
    figure: what the load and the forwards may add to the process, which the
    gate and the page-cache plan see as the host's available memory
    (:func:`_as_if_host_gib`). The baseline is taken after a warm-up (the
    library's first use, said apart: :func:`_warm_up`) and with the model
    built on meta; a budget below what streaming needs at the least is refused
    before anything is written (:func:`~.demo_sizing._check_budget`). The step
    times are reported with their spread and what this run's mode and plan
    make normal (:func:`_step_rows`).

    Raises
    ------
    ValueError
        An argument the demo cannot run or judge (one line, said before anything is written).
    """
    import torch

    out = sys.stdout if out is None else out  # the stream at the call, not at import

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    run = _setup(cfg)
    torch.manual_seed(0)
    failures: list[str] = []
    say(f"mode: {run.mode_line}")
    with tempfile.TemporaryDirectory(prefix="mapoffload-demo-", dir=run.folder) as tmp:
        w = _write_and_reference(cfg, run, tmp, say)
        previous = os.environ.get(ENV_HOST_AVAILABLE_GIB)
        os.environ[ENV_HOST_AVAILABLE_GIB] = _as_if_host_gib(w.budget)  # the warm-up sees a host like the run's
        try:
            ld = _load(cfg, run, w, tmp, say, failures)
            o = _offload(cfg, run, w, ld, say, failures)
        finally:
            if previous is None:
                os.environ.pop(ENV_HOST_AVAILABLE_GIB, None)
            else:
                os.environ[ENV_HOST_AVAILABLE_GIB] = previous

    say("[5/5] report")
    rows = _report_rows(run, w, ld, o)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        say(f"  {k.ljust(width)}  {v}")
    if failures:
        for f in failures:
            say(f"FAILED: {f}")
        return 1
    say("OK")
    return 0
