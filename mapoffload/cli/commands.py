"""`mapoffload inspect PATH [--json]`, `mapoffload demo` and `mapoffload convert FOLDER` (also `python -m mapoffload`).

``-v``/``--verbose`` is accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from .._log import format_bytes

__all__ = ["main"]


WIDTH = 100  # terminal columns the tables and lines fit in


def _say(text: str) -> None:
    """Print ``text`` wrapped to :data:`WIDTH` columns."""
    import textwrap

    print("\n".join(textwrap.wrap(text, WIDTH, subsequent_indent="    ", break_on_hyphens=False)))


def _print_inspect(data: dict) -> None:
    print(f"checkpoint: {data['path']}  ({format_bytes(data['total_bytes'])})")
    rows = [("component / file", "size", "tensors", "dtypes", "in page cache")]
    for c in data["components"]:
        pct = 100 * c["resident_bytes"] / c["bytes"] if c["bytes"] else 0.0
        rows.append((c["component"], format_bytes(c["bytes"]), str(c["tensors"]), "",
                     f"{format_bytes(c['resident_bytes'])} ({pct:.0f} %)"))
        for f in c["files"]:
            dtypes = ", ".join(f"{k}x{v}" for k, v in sorted(f["dtypes"].items())) or "-"
            fpct = 100 * f["resident_bytes"] / f["bytes"] if f["bytes"] else 0.0
            # The file's name only: the component row and the header say where it lies.
            rows.append((f"  {os.path.basename(f['path'])}", format_bytes(f["bytes"]), str(f["tensors"]), dtypes,
                         f"{format_bytes(f['resident_bytes'])} ({fpct:.0f} %)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    # Within 100 columns: a long file name keeps its end (the shard numbers).
    widths[0] = min(widths[0], max(16, WIDTH - sum(widths[1:]) - 2 * (len(widths) - 1)))
    for r in rows:
        name = r[0] if len(r[0]) <= widths[0] else "…" + r[0][-(widths[0] - 1):]
        print("  ".join(cell.ljust(w) for cell, w in zip((name, *r[1:]), widths)).rstrip())
    _say(data["host"]["summary"])
    gate = data["gate"]
    verdict = "keep the checkpoint mapped" if gate["keep_mapped"] else "copy into host memory"
    n = gate["local_ranks"]
    each = "" if n == 1 else f"{n} local ranks x "
    _say(
        f"gate: {verdict} (load_checkpoint, keep_mapping=None) — {each}{format_bytes(data['total_bytes'])} "
        f"of weights against {format_bytes(data['host']['available'])} available minus {each}the "
        f"{format_bytes(gate['reserve_bytes'])} reserve"
    )
    for c in data["components"]:
        if len(data["components"]) > 1:
            print(f"  {c['component']}: {'keep mapped' if c['keep_mapped'] else 'copies fit'}")
    for entry, what in data["entry_points"].items():
        if entry != "load_checkpoint":  # the gate line above says it
            _say(f"{entry}: {what}")
    _print_conversions(data)


def _print_conversions(data: dict) -> None:
    """The conversion folders beside the checkpoint, by root; or where a load would write them."""
    found = data.get("conversions") or []
    if not found:
        if data.get("conversion_root") and set(data["entry_points"]) - {"load_checkpoint"}:
            _say(f"conversions: none yet; a load that converts writes them under {data['conversion_root']}")
        return
    by_root: dict[str, list[dict]] = {}
    for c in found:
        by_root.setdefault(os.path.dirname(c["path"]), []).append(c)
    for root, entries in by_root.items():
        done = [c for c in entries if c["finished"]]
        print(f"conversions: {len(done)} in {root}")  # a path, whole (as the first line's)
        words = [f"{c['key']}: {c['tensors']} tensors, {format_bytes(c['bytes'])}"
                 + (" (vLLM)" if c.get("for") == "vllm" else "") for c in done]
        if done:
            words.append("a load reuses the one made for the same folder, class, dtype, config and versions"
                         + (" (vLLM: and parallel layout, packing)" if any(c.get("for") == "vllm" for c in done)
                            else ""))
        unfinished = len(entries) - len(done)
        if unfinished:
            words.append(f"{unfinished} unfinished (no manifest: converted again by the next load)")
        target = data.get("conversion_root")
        if target and os.environ.get("MAPOFFLOAD_CONVERT_DIR") and os.path.realpath(target) != os.path.realpath(root):
            words.append(f"MAPOFFLOAD_CONVERT_DIR is set: loads write to {data['conversion_root']} instead "
                         f"(cache_dir={root!r} reuses these)")
        _say("    " + "; ".join(words))


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import inspect_checkpoint

    data = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_inspect(data)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(layers=args.layers, width=args.width, tokens=args.tokens, steps=args.steps,
                     device=args.device, host_gib=args.host_gib, cpu_twin=args.cpu_twin)
    return run_demo(cfg)


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..hf._extras import MissingExtraError

    try:
        from ..hf.convert import convert_pretrained

        report = convert_pretrained(args.folder, dtype=args.dtype, cache_dir=args.cache_dir, cls=args.model_class)
    except (OSError, ValueError, MissingExtraError) as exc:  # transformers' own messages span lines: one line
        print(f"mapoffload convert: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return 2
    except Exception as exc:  # transformers' load failed (a config its model class cannot take): said in one line
        if args.verbose:
            raise
        print(f"mapoffload convert: error: transformers could not load {args.folder}: {type(exc).__name__}: "
              f"{' '.join(str(exc).splitlines())} (-v shows the traceback)", file=sys.stderr)
        return 2
    if report.converted_tensors:
        how = "already there, reused" if report.conversion_reused else "written"
        _say(f"{report.converted_tensors} tensors converted by the load ({format_bytes(report.bytes_converted)}), "
             f"{how}: {report.conversion_dir}")
    else:
        _say(f"nothing to convert: every tensor of {args.folder} loads as a view of its file")
    return 0


def _verbose_flag(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log what the library decides (the gate, host stores, residency)")


def _path(text: str) -> str:
    """A path argument with ``~`` expanded: the shell leaves it in ``--cache-dir=~/x`` and in quotes."""
    from .._checks import user_path

    return user_path(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def _gib(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    from ..memory.budget import MAX_HOST_GIB

    if not math.isfinite(value) or value <= 0 or value > MAX_HOST_GIB:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of GiB, at most {MAX_HOST_GIB}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    ap = argparse.ArgumentParser(prog="mapoffload", description="Keep model weights on their checkpoint mapping.")
    ap.add_argument("--version", action="version", version=f"mapoffload {__version__}",
                    help="print the version and exit")
    _verbose_flag(ap, False)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{inspect,demo,convert}", help="what to do")
    ins = sub.add_parser(
        "inspect", help="a checkpoint's files, the host, the gate, page-cache residency",
        description="Show a checkpoint's files (tensors, dtypes, bytes in the page cache), the host's memory and "
                    "whether a load keeps the weights mapped or copies them. Reads headers only.",
    )
    ins.add_argument("path", type=_path,
                     help="a .safetensors file, a *.safetensors.index.json, a .pt/.pth/.bin, or a folder")
    ins.add_argument("--json", action="store_true", help="print the same as JSON")
    # SUPPRESS: a -v given before the subcommand is not reset by the subcommand's default.
    _verbose_flag(ins, argparse.SUPPRESS)
    ins.set_defaults(func=_cmd_inspect)
    demo = sub.add_parser(
        "demo", help="the whole pipeline on a synthetic checkpoint (the main job)",
        description="Write a transformer-like checkpoint to a temporary folder, make the host budget smaller than "
                    "it, load it mapped, stream it layer by layer and check the output against a reference. "
                    "Exits 1 when a check fails, the budget included.",
    )
    demo.add_argument("--layers", type=_positive_int, default=8, help="blocks in the model (default: 8)")
    demo.add_argument("--width", type=_positive_int, default=1024,
                      help="hidden size; a block holds about 12 x width^2 float32 weights (default: 1024)")
    demo.add_argument("--tokens", type=_positive_int, default=256, help="rows of the input (default: 256)")
    demo.add_argument("--steps", type=_positive_int, default=3,
                      help="forwards timed for each of reference and offload; the median is shown (default: 3)")
    demo.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    demo.add_argument("--cpu-twin", action="store_true",
                      help="on the CPU, run the device pipeline's CPU twin (layers copied through the copier "
                           "into separate CPU buffers) instead of computing in place from the mapping")
    demo.add_argument("--host-gib", type=_gib, default=None,
                      help="host budget in GiB, as MAPOFFLOAD_HOST_AVAILABLE_GIB sets it (default: half the "
                           "checkpoint)")
    _verbose_flag(demo, argparse.SUPPRESS)
    demo.set_defaults(func=_cmd_demo)
    conv = sub.add_parser(
        "convert", help="do a transformers folder's load-time conversions ahead of time",
        description="Load a transformers model folder once, as mapoffload.from_pretrained does, so that what "
                    "transformers converts while loading (experts fused, a cast, fp8 dequantized without a GPU) "
                    "is written to the mapped conversion folder that later loads reuse. Needs transformers.",
    )
    conv.add_argument("folder", type=_path,
                      help="a folder written by save_pretrained (config.json and weight files)")
    conv.add_argument("--dtype", default="auto",
                      help="the dtype later loads will ask for: 'auto' (as transformers 5) or one of bfloat16, "
                           "float16, float32, float64 (default: auto)")
    conv.add_argument("--class", dest="model_class", default=None, metavar="CLASS",
                      help="the transformers class later loads pass to from_pretrained, e.g. LlamaForCausalLM or "
                           "an Auto class (AutoModelForCausalLM counts as the class it resolves to; default: "
                           "config.json's architectures)")
    conv.add_argument("--cache-dir", default=None, type=_path,
                      help="where converted files go (default: beside the checkpoint when writable, else "
                           "~/.cache/mapoffload/converted; MAPOFFLOAD_CONVERT_DIR overrides)")
    _verbose_flag(conv, argparse.SUPPRESS)
    conv.set_defaults(func=_cmd_convert)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`| head`): nothing to say, and nothing more to write to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE
    except (OSError, ValueError) as exc:
        print(f"mapoffload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
