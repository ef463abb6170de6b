"""The figure of benchmarks/vllm_serve.py: matplotlib (``pip install matplotlib``; the benchmarks'
own dependency, not the package's), drawn from the JSON the script writes."""

from __future__ import annotations

MIB = 1 << 20


def vllm_serve_figure(payload: dict, path: str) -> None:
    """Three panels: anonymous memory over import and KV cache per contender, decode tokens/s per
    contender and cap, and bytes read per forward under each cap against the plan and the model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in payload["results"] if r["name"] != "dummy"]
    capped = [r for r in payload.get("capped", {}).get("runs", []) if "tokens_per_s" in r]
    weights = payload["weights_bytes"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

    ax = axes[0]
    names = [r["name"] for r in results]
    ax.bar(names, [r["anon_over_base"] / MIB for r in results], color="#4c72b0")
    ax.axhline(weights / MIB, color="gray", linestyle="--", label="the model")
    ax.set_ylabel("MiB anonymous over import + KV cache")
    ax.set_title("memory the engine holds besides vLLM's own")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()

    ax = axes[1]
    decode = [r for r in results if r.get("tokens_per_s")] + capped
    labels = [r["name"] for r in decode]
    ax.bar(labels, [r["tokens_per_s"] for r in decode], color="#55a868")
    for r in capped:
        if r.get("allowed_tokens_per_s"):
            ax.plot([r["name"]], [r["allowed_tokens_per_s"]], marker="_", markersize=30, color="black")
    ax.set_ylabel("decode tokens/s (black: what the disk allows)")
    ax.set_title("decode")
    ax.tick_params(axis="x", rotation=30)

    ax = axes[2]
    if capped:
        labels = [r["name"] for r in capped]
        x = range(len(capped))
        ax.bar([i - 0.2 for i in x], [r["read_per_forward"] / MIB for r in capped], width=0.4, label="read")
        ax.bar([i + 0.2 for i in x], [((r.get("plan") or {}).get("streamed") or 0) / MIB for r in capped],
               width=0.4, label="the plan streams")
        ax.axhline(weights / MIB, color="gray", linestyle="--", label="the model")
        ax.set_xticks(list(x), labels)
        ax.legend()
    ax.set_ylabel("MiB per forward")
    ax.set_title("reads under a cap")
    fig.suptitle(f"vLLM CPU build, {weights / 2**30:.2f} GiB bf16 Llama: {payload['machine']}, {payload['date']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
