"""`mapoffload inspect PATH [--json]` and `mapoffload demo` (also `python -m mapoffload`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from ._log import format_bytes

__all__ = ["main"]


def _print_inspect(data: dict) -> None:
    print(f"checkpoint: {data['path']}  ({format_bytes(data['total_bytes'])})")
    rows = [("component / file", "size", "tensors", "dtypes", "in page cache")]
    for c in data["components"]:
        pct = 100 * c["resident_bytes"] / c["bytes"] if c["bytes"] else 0.0
        rows.append((c["component"], format_bytes(c["bytes"]), str(c["tensors"]), "",
                     f"{format_bytes(c['resident_bytes'])} ({pct:.0f} %)"))
        for f in c["files"]:
            dtypes = ", ".join(f"{k}x{v}" for k, v in sorted(f["dtypes"].items())) or "?"
            fpct = 100 * f["resident_bytes"] / f["bytes"] if f["bytes"] else 0.0
            rows.append((f"  {f['path']}", format_bytes(f["bytes"]),
                         "?" if f["tensors"] is None else str(f["tensors"]), dtypes,
                         f"{format_bytes(f['resident_bytes'])} ({fpct:.0f} %)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    print(data["host"]["summary"])
    gate = data["gate"]
    verdict = "keep the checkpoint mapped" if gate["keep_mapped"] else "copy into host memory"
    print(
        f"gate: {verdict} — {format_bytes(data['total_bytes'])} of weights against "
        f"{format_bytes(data['host']['available'])} available minus the "
        f"{format_bytes(gate['reserve_bytes'])} reserve"
    )
    for c in data["components"]:
        if len(data["components"]) > 1:
            print(f"  {c['component']}: {'keep mapped' if c['keep_mapped'] else 'copies fit'}")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect_checkpoint import inspect_checkpoint

    data = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_inspect(data)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(layers=args.layers, width=args.width, tokens=args.tokens, steps=args.steps,
                     device=args.device, host_gib=args.host_gib)
    return run_demo(cfg)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mapoffload", description="Keep model weights on their checkpoint mapping.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log what the library decides")
    sub = ap.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="a checkpoint's files, the host, the gate, page-cache residency")
    ins.add_argument("path", help="a .safetensors file, a *.safetensors.index.json, a .pt/.bin, or a folder")
    ins.add_argument("--json", action="store_true", help="print JSON")
    ins.set_defaults(func=_cmd_inspect)
    demo = sub.add_parser("demo", help="the whole pipeline on a synthetic checkpoint (the main job)")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--width", type=int, default=1024)
    demo.add_argument("--tokens", type=int, default=256)
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    demo.add_argument("--host-gib", type=float, default=None, help="host budget (default: half the checkpoint)")
    demo.set_defaults(func=_cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (OSError, ValueError) as exc:
        print(f"mapoffload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
