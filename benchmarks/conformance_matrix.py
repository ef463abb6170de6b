"""The conformance matrix as a table: every architecture of the test zoo
(tests/conformance_zoo.py: tiny random models saved by transformers itself,
every weight perturbed off its initial value) loaded by transformers'
``from_pretrained`` and by ``mapoffload.from_pretrained(cls, folder,
device="cpu")`` with defaults.

Columns: the stacks ``offload`` found, tensors converted into the mapped
conversion folder (fused experts, dequantized fp8), bytes left anonymous (as
the LoadReport names them), the largest |difference| of the outputs, and
whether ``generate()`` with the folder's generation config gave the same
tokens (decoders). Rows for the fine-grained FP8 layout (Llama, Mixtral) and
a bf16 sharded Mixtral follow the zoo.

Run: python benchmarks/conformance_matrix.py [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))  # conformance_zoo; appended: shadows nothing


def row(name: str, variant: str, **build_kw) -> dict:
    import torch

    import mapoffload
    from conformance_zoo import build, first_output, inputs, to_fp8

    with tempfile.TemporaryDirectory() as folder:
        cls, kind = build(name, folder, **build_kw)
        if variant == "fp8":
            to_fp8(folder)
        ref = cls.from_pretrained(folder).eval()
        x = inputs(kind, ref.config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = mapoffload.from_pretrained(cls, folder, device="cpu")
        with torch.no_grad():
            diff = (first_output(ref(**x)).float() - first_output(model(**x)).float()).abs().max().item()
        same_tokens = None
        if kind == "causal":
            ids = torch.tensor([[3, 17, 42]])
            with torch.no_grad():
                same_tokens = bool(torch.equal(ref.generate(ids), model.generate(ids)))
        report, handle = model.mapoffload_report, model.mapoffload_handle
        out = {"arch": name, "variant": variant, "kind": kind, "stacks": list(handle.managers),
               "converted": report.converted_tensors, "fp8": report.fp8_weights, "anonymous": report.bytes_copied,
               "max_diff": diff,
               "generate_equal": same_tokens}
        handle.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    import transformers

    from _common import emit_json, machine, print_table
    from conformance_zoo import zoo

    transformers.logging.set_verbosity_error()
    rows = [row(name, "fp32") for name in sorted(zoo())]
    import importlib.util

    if importlib.util.find_spec("accelerate"):  # transformers' fp8 quantizer needs it
        rows += [row(n, "fp8", dtype=torch.bfloat16) for n in ("llama", "mixtral")]
    rows.append(row("mixtral", "bf16 sharded", dtype=torch.bfloat16, shard="40KB"))
    print(f"# conformance matrix: transformers {transformers.__version__}, torch {torch.__version__}; {machine()}")
    print_table(["architecture", "variant", "stacks streamed", "converted", "fp8 kept", "anonymous B", "max abs diff",
                 "generate =="],
                [[r["arch"], r["variant"], ", ".join(s for s in r["stacks"] if s != "rest") or "(none: rest)",
                  r["converted"], r["fp8"], r["anonymous"], f"{r['max_diff']:.3g}",
                  "-" if r["generate_equal"] is None else r["generate_equal"]] for r in rows])
    emit_json("conformance_matrix", {"transformers": transformers.__version__, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
