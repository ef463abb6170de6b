"""For capped_forward.py --fp8: a saved model rewritten in the fine-grained FP8
layout, and the figure of reads and forward time against the cap."""

from __future__ import annotations

import json
import os
import shutil

BLOCK = 128
MIB = 1 << 20


def quantize_folder(src: str, dst: str) -> dict:
    """Copy a transformers folder to ``dst`` with every ``*_proj.weight`` in FP8
    (DeepSeek-V3's layout: the embeddings and the head stay as they are).
    Returns the sizes of the new checkpoint."""
    from safetensors.torch import load_file, save_file

    from mapoffload.loading.fp8 import quantize_fp8

    os.makedirs(dst, exist_ok=True)
    weight_map = {}
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    for name in shards:
        state = load_file(os.path.join(src, name))
        out = {}
        for k, v in state.items():
            if k.endswith("proj.weight") and v.dim() == 2:
                out[k], out[f"{k}_scale_inv"] = quantize_fp8(v, (BLOCK, BLOCK))
            else:
                out[k] = v
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in out})
        del state, out
    for f in os.listdir(src):
        if f.endswith(".json") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    for f in os.listdir(src):
        if f.endswith(".index.json"):
            with open(os.path.join(src, f)) as fh:
                index = json.load(fh)
            index["weight_map"] = weight_map
            with open(os.path.join(dst, f), "w") as fh:
                json.dump(index, fh, indent=2)
    with open(os.path.join(dst, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                     "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return {"checkpoint_bytes": sum(os.path.getsize(os.path.join(dst, f)) for f in shards), "shards": len(shards)}


def figure(results: list[dict], path: str) -> str | None:
    """Bytes read per forward and forward seconds against the cap, one line per
    contender; None (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    caps = list(dict.fromkeys(r["cap"] for r in results))
    labels = ["no cap" if c == "none" else f"base+{c}%" for c in caps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for contender in dict.fromkeys(r["contender"] for r in results):
        by_cap = {r["cap"]: r for r in results if r["contender"] == contender and r.get("outcome") == "yes"}
        xs = [i for i, c in enumerate(caps) if c in by_cap]
        top.plot(xs, [by_cap[caps[i]]["read_bytes_per_forward"] / 1e6 for i in xs], marker="o", label=contender)
        bottom.plot(xs, [by_cap[caps[i]]["forward_s_mean"] for i in xs], marker="o", label=contender)
    top.set_ylabel("read per forward (MB)")
    bottom.set_ylabel("forward (s)")
    bottom.set_xticks(range(len(caps)), labels)
    bottom.set_xlabel("memory cap (above the baseline, % of the bf16 checkpoint)")
    top.legend()
    top.set_title("capped_forward --fp8: bytes read and time per forward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
