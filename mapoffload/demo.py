"""`mapoffload demo`: the whole library on a synthetic checkpoint, on any machine.

Builds a transformer-like checkpoint in a temporary folder, makes the host
budget smaller than it (as ``MAPOFFLOAD_HOST_AVAILABLE_GIB`` would), loads it
with ``load_checkpoint`` under ``empty_weights()`` (the gate decides), runs the
layerwise offload manager on the best device present, checks the output
against a reference computed without offload, and reports.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TextIO

from ._log import format_bytes
from .budget import ENV_HOST_AVAILABLE_GIB, rss_anon_bytes

__all__ = ["DemoConfig", "run_demo"]


@dataclass
class DemoConfig:
    layers: int = 8
    width: int = 1024
    tokens: int = 256
    steps: int = 3
    device: str | None = None  # None: cuda if present, else cpu
    host_gib: float | None = None  # None: half the checkpoint


def _model_class():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            x = x + self.proj(att @ v)
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class DemoModel(nn.Module):
        def __init__(self, layers: int, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.register_buffer("scale", torch.ones(width), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x * self.scale

    return DemoModel


def run_demo(cfg: DemoConfig, out: TextIO = sys.stdout) -> int:
    """Run the demo; return the process exit code (0 when every check passed)."""
    import torch
    from safetensors.torch import save_file

    from .checkpoint import checkpoint_bytes, empty_weights, load_checkpoint
    from .copier import Copier
    from .offload import LayerwiseOffloadManager
    from .regions import cow_report

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    Model = _model_class()
    torch.manual_seed(0)
    failures = []
    with tempfile.TemporaryDirectory(prefix="mapoffload-demo-", dir=os.environ.get("MAPOFFLOAD_DEMO_DIR")) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        say(f"[1/5] writing a {cfg.layers}-layer, width-{cfg.width} checkpoint to {path}")
        state = {}
        ref = Model(cfg.layers, cfg.width)
        for i, block in enumerate(ref.blocks):
            for name, p in block.named_parameters():
                state[f"blocks.{i}.{name}"] = p.detach().contiguous()
            say(f"      layer {i + 1}/{cfg.layers} generated")
        save_file(state, path)
        del state
        size = checkpoint_bytes(path)
        host_gib = cfg.host_gib if cfg.host_gib is not None else size / 2 / (1 << 30)
        say(f"      {format_bytes(size)} on disk; host budget set to {host_gib:.3f} GiB ({ENV_HOST_AVAILABLE_GIB})")

        say("[2/5] reference output without offload")
        x = torch.randn(cfg.tokens, cfg.width, device=device)
        ref.to(device)
        with torch.inference_mode():
            expected = ref(x)
            t_ref = _time(lambda: ref(x), cfg.steps, device)
        del ref

        previous = os.environ.get(ENV_HOST_AVAILABLE_GIB)
        os.environ[ENV_HOST_AVAILABLE_GIB] = repr(host_gib)
        try:
            say("[3/5] load_checkpoint under empty_weights(), the gate deciding")
            anon0 = rss_anon_bytes()
            with empty_weights():
                model = Model(cfg.layers, cfg.width)
            model.scale = model.scale.to(device)
            report = load_checkpoint(model, path)
            say(f"      {report}")
            if not report.keep_mapping:
                failures.append("the gate chose to copy a checkpoint larger than the budget")
            hosts = list(model.parameters())
            cow0 = cow_report(hosts).anonymous_bytes

            say(f"[4/5] layerwise offload on {device}")
            copier = Copier(device)
            # On the CPU the demo runs the device pipeline's twin: the copies are what it shows.
            mgr = LayerwiseOffloadManager(model, "blocks", device=device, prefetch_layers=1, copier=copier,
                                          cpu_twin=device.type == "cpu")
            per_layer = []
            for i in range(cfg.layers):
                t0 = time.perf_counter()
                mgr.prefetch_layer(i, non_blocking=False)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                nbytes = mgr.layer_bytes(i)
                per_layer.append(nbytes / dt / 1e9)
                mgr.release_layer(i)
                say(f"      layer {i + 1}/{cfg.layers}: {format_bytes(nbytes)} copied at {per_layer[-1]:.2f} GB/s")
            mgr.register_forward_hooks()
            with torch.inference_mode():
                got = model(x)
                t_off = _time(lambda: model(x), cfg.steps, device)
            same = torch.equal(got, expected) if device.type == "cpu" else torch.allclose(got, expected, 1e-4, 1e-5)
            if not same:
                failures.append("offloaded output differs from the reference")
            turned = cow_report(hosts).anonymous_bytes - cow0
            if turned:
                failures.append(f"{turned} bytes of the mapping turned anonymous")
            anon = rss_anon_bytes() - anon0
            mapped = mgr.mapped_bytes
            mgr.close()
            copier.close()
        finally:
            if previous is None:
                os.environ.pop(ENV_HOST_AVAILABLE_GIB, None)
            else:
                os.environ[ENV_HOST_AVAILABLE_GIB] = previous

    say("[5/5] report")
    rows = [
        ("device", str(device)),
        ("checkpoint bytes", f"{size} ({format_bytes(size)})"),
        ("left on the file mapping", f"{mapped} ({format_bytes(mapped)})"),
        ("host anonymous growth", f"{format_bytes(anon)} (copier slots and, on CPU, the device buffers)"),
        ("mapping turned anonymous", f"{turned} bytes"),
        ("copy bandwidth per layer", f"{min(per_layer):.2f}-{max(per_layer):.2f} GB/s"),
        ("step time", f"{t_off * 1e3:.1f} ms offloaded vs {t_ref * 1e3:.1f} ms resident ({t_off / t_ref:.2f}x)"),
        ("output check", "identical to the reference" if same else "MISMATCH"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        say(f"  {k.ljust(width)}  {v}")
    if failures:
        for f in failures:
            say(f"FAILED: {f}")
        return 1
    say("OK")
    return 0


def _time(fn, steps: int, device) -> float:
    import statistics

    import torch

    times = []
    for _ in range(max(1, steps)):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
