"""The device path reads ahead as in place does (issue 43): on the CPU twin - the device pipeline, its
copier and its side stream, with CPU buffers - the next layer's copy runs while a layer computes, and
is done by the time that layer's compute ends. (The CUDA streams' order is checked on the stand-in
runtime by test_device_uncached_cuda.py and test_copier_cuda.py.)"""

from __future__ import annotations

import time

import torch

from mapoffload import LayerwiseOffloadManager
from stacks import LAYERS, mapped

COMPUTE_S = 0.05  # each layer computes at least this long (a hook sleeps after its forward)


def _observed(ckpt, ahead: int) -> list[tuple[bool, bool]]:
    """For each layer but the last, (the next layer's load began before this layer's compute ended, its
    copy was done by then), on the twin with ``prefetch_layers=ahead``; the output checked."""
    path, x, want = ckpt
    model = mapped(path)
    seen: list[tuple[bool, bool]] = []
    with LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=True, prefetch_layers=ahead) as mgr:
        seq = mgr.parts.sequencer

        def computing(i):
            def hook(module, args, output):  # inside the layer's turn: before the manager's post-hook
                time.sleep(COMPUTE_S)
                if i + 1 < LAYERS:
                    load = seq.loaded.get(i + 1)
                    handle = None if load is None else load.handle
                    seen.append((load is not None, load is not None and (handle is None or handle.done())))
            return hook

        hooks = [b.register_forward_hook(computing(i), prepend=True) for i, b in enumerate(model.blocks)]
        mgr.register_forward_hooks()
        try:
            with torch.no_grad():
                assert torch.equal(model(x), want)
        finally:
            for h in hooks:
                h.remove()
    return seen


def test_on_the_twin_the_next_layers_copy_runs_while_a_layer_computes(ckpt):
    seen = _observed(ckpt, ahead=1)
    assert len(seen) == LAYERS - 1
    assert all(began for began, _ in seen), seen
    assert all(done for _, done in seen), seen  # copied beside the compute: nothing left for the next pre-hook


def test_without_read_ahead_nothing_is_copied_while_a_layer_computes(ckpt):
    """The control: with ``prefetch_layers=0`` the next layer's copy starts at its own pre-hook."""
    assert _observed(ckpt, ahead=0) == [(False, False)] * (LAYERS - 1)
