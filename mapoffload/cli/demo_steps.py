"""The demo's timing: step 4's copy of each layer (:func:`copy_layers`) and the library's buffers it
names (:func:`library_buffers`); each forward timed, and the report's rows on what the ratio
measures, how much it moves between steps, and what ratio this run's mode and page-cache plan make
normal."""

from __future__ import annotations

import time

from .._log import format_bytes

__all__ = ["copy_layers", "library_buffers", "step_rows", "time_steps"]


def time_steps(fn, steps: int, device) -> list[float]:
    """Wall seconds of each of ``steps`` calls of ``fn`` (at least one), the device synchronised."""
    import torch

    times = []
    for _ in range(max(1, steps)):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def step_rows(t_off: list[float], t_ref: list[float], mode: str, plan, copy_s: float,
               kept: bool) -> list[tuple[str, str]]:
    """The report's rows on step time: the medians and their ratio, the spread of the steps (the
    ratio any offloaded step makes with any resident one) and, from what this run does (its mode,
    its page-cache ``plan``, its layers' copy time ``copy_s`` at step 4's bandwidth, whether the
    gate ``kept`` the checkpoint on its mapping), what ratio is normal.

    The ratio is an offloaded forward's wall time over the resident model's (the same model and
    input, every weight in the reference's own memory), the two timed one after the other, not
    interleaved: another load on the machine moves either, and with few steps the ratio moves
    with it (one machine measured 0.70x busy and 1.66x idle at three steps).
    """
    import statistics

    off, ref = statistics.median(t_off), statistics.median(t_ref)
    n = min(len(t_off), len(t_ref))
    of = f"the median of {n} forwards each" if n > 1 else "one forward each"
    rows = [("step time", f"{_ms(off)} offloaded vs {_ms(ref)} resident: {off / ref:.2f}x ({of}, timed one after "
                          "the other; the ratio is an offloaded forward's wall time over the resident model's, "
                          "whose weights are in its own memory)")]
    if n > 1:
        low, high = min(t_off) / max(t_ref), max(t_off) / min(t_ref)
        rows.append(("step time spread",
                     f"offloaded {_ms(min(t_off))}-{_ms(max(t_off))}, resident {_ms(min(t_ref))}-{_ms(max(t_ref))}:"
                     f" the ratio of any offloaded step to any resident one lies in {low:.2f}x-{high:.2f}x; a busy "
                     "machine widens it (more --steps: a steadier median)"))
    else:
        rows.append(("step time spread", "one forward each: no spread measured, and another load on the machine "
                                         "can move the ratio either way (more --steps: a spread and a steadier "
                                         "median)"))
    hooks = ("; the hooks add a small fixed cost a layer, which shows where a layer computes in a few "
             "milliseconds or less (a small --width or --tokens)")
    streamed = plan is not None and plan.streamed and kept
    reread = (f"{len(plan.streamed)} of {len(plan.layer_bytes)} layers ({format_bytes(plan.streamed_bytes)}) are "
              f"re-read from the file every forward ({_held(plan)}), which adds their read time") if streamed else ""
    high = None
    if mode != "in place":
        low = max(1.0, copy_s / ref)
        copies = (f"every forward also copies each layer ({_ms(copy_s)} for all of them at step 4's bandwidth), "
                  "behind the compute at best, after it at worst")
        if streamed:  # step 4 copied from pages the load left cached: the forwards read them again
            normal = f"{low:.2f}x and more: {copies}; and {reread}{hooks}"
        else:
            high = 1 + copy_s / ref
            normal = f"{low:.2f}x-{high:.2f}x: {copies}{hooks}"
    elif streamed:
        normal = f"1x and more: {reread}{hooks}; the compute is the reference's, so below 1x is the machine's noise"
    else:
        where = ("from the same bytes, in the file mapping's page cache instead of anonymous memory" if kept
                 else "from the gate's copies in host memory, as the reference computes from its own")
        normal = f"about 1x: the layers compute {where}{hooks}; below 1x is the machine's noise"
    if high is not None and off / ref > high:
        normal += (f". This run's {off / ref:.2f}x lies above that range: not a check, but not what this mode and "
                   "plan make normal either (a busy machine, or copies slower than at step 4; more --steps: a "
                   "steadier median)")
    rows.append(("step time normal", normal))
    return rows


def _held(plan) -> str:
    """Why the plan re-reads its streamed layers: what the page cache it has for them holds."""
    if plan.cached:
        return "the page cache the budget leaves holds the rest"
    n, window, layer = plan.window_layers, format_bytes(plan.window_bytes), format_bytes(max(plan.layer_bytes))
    streaming = f"the {n} layer{'s' if n != 1 else ''} streamed at once"
    left = (f"{streaming} take {window} of it, which leaves less than one {layer} layer to keep cached"
            if plan.window_bytes < plan.budget else f"{streaming} need {window}: none is left to keep a layer cached")
    return (f"the plan has {format_bytes(plan.budget)} of page cache for these layers (the host budget less the "
            f"page-cache margin and the memory the process added since); {left}")


def copy_layers(mgr, layers: int, device, copies: bool, kept: bool, say) -> list[float]:
    """Step 4: each layer copied once through the pipeline and released, timed (GB/s each), or,
    in place, said where it computes from."""
    import torch

    per_layer = []
    for i in range(layers):
        nbytes = mgr.parts.layer_bytes(i)
        if not copies:
            where = "on the file mapping" if kept else "in host memory (the gate's copy)"
            say(f"      layer {i + 1}/{layers}: {format_bytes(nbytes)} {where}, computed from there")
            continue
        t0 = time.perf_counter()
        mgr.prefetch_layer(i, non_blocking=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        per_layer.append(nbytes / dt / 1e9)
        mgr.release_layer(i)
        where = "the device" if device.type == "cuda" else "its CPU buffer"
        say(f"      layer {i + 1}/{layers}: {format_bytes(nbytes)} copied to {where} at "
            f"{per_layer[-1]:.2f} GB/s")
    return per_layer


def library_buffers(mgr, copier, mode: str, report) -> str:
    """The library's own host buffers, as it accounts them (capacities: at most what is resident),
    the gate's copies first when it copied: one phrase for the budget's line."""
    buffers = [("uncached window", mgr.parts.loads.window_bytes)]
    if copier is not None:
        buffers.append(("staging ring", copier.ring_bytes))
    if mode == "cpu twin":
        buffers.append(("twin's layer buffers", mgr.peak_device_bytes))
    buffers = [(name, n) for name, n in buffers if n]
    if not report.keep_mapping:
        buffers.insert(0, ("the gate's copies", report.bytes_copied))
    notes = {"uncached window": " (the streamed layers read from the file into reused buffers, in place too: "
                                   "no copy of the weights is kept)"}
    return ("the library's buffers (capacity): " + ", ".join(f"{name} {format_bytes(n)}{notes.get(name, '')}"
                                                             for name, n in buffers)
            if buffers else "no buffers of the library")
