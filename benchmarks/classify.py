"""How fast "which of these tensors live on a file mapping?" is answered.

Builds real safetensors files with N tensors (plus anonymous tensors), loads
them (mapped views), and times side by side, in one run:

  a) seed      the seed runtime's path: one Python parse of /proc/self/maps,
               then bisect per tensor on untyped_storage().data_ptr()
  b) per-read  one /proc/self/maps read per tensor (the quadratic path),
               timed on a sample and extrapolated
  c) ours      MappedRegions() + classify(tensors): snapshot, extraction and
               classification end to end
  c') the same with is_cpu read for every tensor, as classify() does
               in a process where an accelerator runtime is initialised
  d) core      the native classifier on prebuilt pointer arrays alone
  e) floor     extracting (data_ptr, nbytes) alone, natively, without the
               device check (e_py: the same as a Python list comprehension)

plus the native parse of a synthetic 100k-line maps text.

Run: python benchmarks/classify.py [--counts 10000 50000 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import torch
from safetensors.torch import load_file, save_file

from _common import emit_json, machine, print_table, timeit
from mapoffload import MappedRegions, _core, tensor_spans


def seed_read_process_mappings():
    """The seed's _read_process_mappings: Python parse of /proc/self/maps."""
    starts, ends, backed = [], [], []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = parts[0].split("-")
            path = parts[5].strip() if len(parts) > 5 else ""
            starts.append(int(lo, 16))
            ends.append(int(hi, 16))
            backed.append(path.startswith("/") and not path.startswith("/dev/") and "memfd:" not in path)
    return starts, ends, backed


def seed_classify(tensors):
    starts, ends, backed = seed_read_process_mappings()
    out = []
    for t in tensors:
        if t.device.type != "cpu":
            out.append(False)
            continue
        p = t.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, p) - 1
        out.append(p != 0 and i >= 0 and p < ends[i] and backed[i])
    return out


def per_read_classify(tensors):
    return [seed_classify([t])[0] for t in tensors]


def synthetic_maps(lines: int) -> str:
    out = []
    addr = 0x7F0000000000
    for i in range(lines):
        path = f"/models/shard-{i % 97:05d}.safetensors" if i % 3 else ""
        dev, inode = ("fd:01", 1000 + i % 97) if path else ("00:00", 0)
        out.append(f"{addr:x}-{addr + 0x3000:x} rw-p {i * 0x3000:08x} {dev} {inode}{' ' * 26}{path}")
        addr += 0x4000
    return "\n".join(out) + "\n"


def build(tmpdir: str, count: int, anon_fraction: float):
    n_anon = int(count * anon_fraction)
    n_file = count - n_anon
    path = os.path.join(tmpdir, f"w{count}.safetensors")
    save_file({f"layer.{i}.weight": torch.full((16,), float(i)) for i in range(n_file)}, path)
    loaded = load_file(path)
    tensors = list(loaded.values()) + [torch.zeros(16) for _ in range(n_anon)]
    return tensors, n_file


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[10_000, 50_000, 100_000])
    ap.add_argument("--anon-fraction", type=float, default=0.1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sample", type=int, default=200, help="tensors timed for the per-read path")
    ap.add_argument("--maps-lines", type=int, default=100_000)
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args(argv)

    print(f"machine: {machine()}")
    rows, results = [], []
    with tempfile.TemporaryDirectory(dir=os.environ.get("MAPOFFLOAD_BENCH_DIR")) as tmp:
        for count in args.counts:
            tensors, n_file = build(tmp, count, args.anon_fraction)
            expected = MappedRegions().classify(tensors)
            assert sum(expected) == n_file, (sum(expected), n_file)
            assert seed_classify(tensors) == expected
            spans = tensor_spans(tensors)
            table = MappedRegions().table
            ttype = torch.Tensor
            t_a = timeit(lambda: seed_classify(tensors), args.repeat)
            sample = tensors[: args.sample]
            t_b = timeit(lambda: per_read_classify(sample), 1, 0) * count / len(sample)
            t_c = timeit(lambda: MappedRegions().classify(tensors), args.repeat)
            t_cdev = timeit(lambda: MappedRegions().table.classify_tensors(tensors, ttype, True), args.repeat)
            t_d = timeit(lambda: table.holds_spans(spans), args.repeat)
            t_e = timeit(lambda: _core.extract_spans(tensors, ttype, False), args.repeat)
            t_epy = timeit(lambda: [(t.data_ptr(), t.nbytes) for t in tensors], args.repeat)
            r = {
                "tensors": count, "vmas": len(table), "seed_s": t_a, "per_read_s_extrapolated": t_b,
                "ours_s": t_c, "ours_device_checked_s": t_cdev, "core_s": t_d, "floor_s": t_e, "floor_python_s": t_epy,
                "speedup_vs_seed": t_a / t_c, "ours_over_floor": t_c / t_e,
                "device_checked_speedup_vs_seed": t_a / t_cdev,
            }
            results.append(r)
            ms = lambda s: f"{s * 1e3:.2f}"
            rows.append([count, len(table), ms(t_a), ms(t_b), ms(t_c), ms(t_cdev), ms(t_d), ms(t_e), ms(t_epy),
                         f"{t_a / t_c:.1f}x", f"{t_c / t_e:.2f}x"])
            del tensors, spans
        text = synthetic_maps(args.maps_lines)
        t_parse = timeit(lambda: _core.parse_maps(text), args.repeat)

    print()
    print_table(["tensors", "VMAs", "a) seed ms", "b) per-read ms (extrap.)", "c) ours ms", "c') ours, is_cpu read ms", "d) core ms",
                 "e) floor ms", "e_py) floor py ms", "a/c", "c/e"], rows)
    print(f"\nnative parse of a synthetic {args.maps_lines}-line maps text: {t_parse * 1e3:.2f} ms")
    last = results[-1]
    print(
        f"targets at {last['tensors']} tensors: c >= 5x faster than a: {last['speedup_vs_seed']:.1f}x; "
        f"c within 1.3x of e: {last['ours_over_floor']:.2f}x; d < 1 ms: {last['core_s'] * 1e3:.3f} ms; "
        f"parse < 20 ms: {t_parse * 1e3:.2f} ms"
    )
    emit_json("classify", {"results": results, "parse_lines": args.maps_lines, "parse_s": t_parse}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
