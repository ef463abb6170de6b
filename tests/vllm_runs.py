"""Run vLLM engines, one after another in one process, and print what each did as JSON.

Not a test module: ``tests/test_vllm_engine.py`` runs it in a subprocess (vLLM's
import costs tens of seconds; every engine after the first a few). Input on
stdin: ``{"runs": [{"name", "folder", "load_format", "extra", "dtype",
"prompts", "max_tokens", "before": null | "corrupt", "engine": {more LLM(...) keywords},
"hold": null | PATH, "env": {VARIABLE: VALUE} set while the run's engine starts and runs
(``MAPOFFLOAD_VLLM_CPU_TWIN``: the CPU twin), "update": null | [NAME PART, ...]}]}``. With ``update``, once
it has generated, a run updates its weights as RLHF weight syncing does (the model's ``load_weights`` in the
worker, given the negated checkpoint tensors whose names hold one of the parts), generates again
(``tokens_after_update``), and reports the digests of the conversion folders' files before and after
(``conversion_digests``). With ``reload`` (``{"folder", "from": "iterator" | "disk"}``), vLLM's
``reload_weights`` from that folder, then ``tokens_after_reload``. Output: one line ``RESULTS <json>`` with, per run, the
tokens and logprobs of every prompt, where each parameter's bytes live (the
checkpoint's files, a conversion folder, anonymous memory) as the process's
mappings say, and the page-cache coordinator's peers (other ranks and replicas
under this cap); for the managers on the device path (offloaded layers), the
bytes their copier moved during ``generate``, the forwards counted by a hook of
our own, each layer's parameter bytes (from the parameters' shapes) and whether
their host weights are mapped. With ``hold``, a run prints ``HOLD <json>`` once
it has generated and keeps its engine up until the file PATH exists (a parent
measures several at once).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _maps() -> list[tuple[int, int, str]]:
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            rows.append((lo, hi, parts[5].strip() if len(parts) > 5 else ""))
    return rows


def _gemm_packs(dtype) -> bool:  # noqa: ANN001
    """Whether vLLM's CPU backend hands linear weights of ``dtype`` to its GEMM library on this CPU:
    oneDNN builds a matmul for them (on an AVX2-only CPU it has none for bf16, and vLLM falls back to
    torch's linear, keeping the weights: nothing is packed)."""
    import torch
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=dtype).t(), 32)
    except RuntimeError:
        return False
    return True


def _where(model) -> dict:  # noqa: ANN001
    import mapoffload

    every = [(n, p) for n, p in model.named_parameters() if p.numel()]
    params = [(n, p) for n, p in every if type(p).__name__ != "OffloadedWeight"]
    mapped = mapoffload.MappedRegions().classify([p for _, p in params])
    rows = _maps()
    out = {"checkpoint": 0, "conversion": 0, "anonymous": 0, "other": 0, "unmapped": [],
           "placeholders": sum(p.numel() * p.element_size() for _, p in every if type(p).__name__ == "OffloadedWeight")}
    for (name, p), is_mapped in zip(params, mapped):
        n = p.numel() * p.element_size()
        path = next((r[2] for r in rows if r[0] <= p.data_ptr() < r[1]), "")
        if not is_mapped:
            out["anonymous"] += n
            out["unmapped"].append(name)
        elif ".mapoffload-converted" in path:
            out["conversion"] += n
        elif path.endswith(".safetensors"):
            out["checkpoint"] += n
        else:
            out["other"] += n
    handle = getattr(model, "mapoffload_handle", None)  # the OffloadHandle every entry point returns
    managers = list(handle.managers.values()) if handle is not None else []
    out["managers"] = len(managers)
    out["streaming"] = [{"reads": m.parts.member.reads_mode, "resident": sum(m.parts.pages.resident_bytes()),
                         "mapped": m.mapped_bytes, "repr": repr(m), **_device_path(m)} for m in managers]
    from mapoffload.pagecache.coordinator import coordinator

    c = coordinator()
    c.follow_cap()  # the peers as they are now (a forward reads them too)
    out["pid"] = os.getpid()
    out["peers"] = {"ranks": list(c.ranks), "replicas": list(c.replicas), "describe": c.describe()}
    bound = getattr(model, "mapoffload_bound", None)
    from mapoffload.vllm._compute import mapped_layout, packed_layers

    out["layout"] = mapped_layout()  # where vLLM's small-GEMM kernel runs: "vnni", else "plain"
    out["vnni_layers"] = len(packed_layers(model))
    out["bound"] = None if bound is None else {"mapped": bound.mapped, "converted": bound.converted,
                                               "copied": bound.copied, "reused": bound.reused,
                                               "packed": bound.packed}
    dtype = next((p.dtype for _, p in every if p.is_floating_point()), None)
    out["gemm_packs"] = dtype is not None and _gemm_packs(dtype)
    return out


def _device_path(manager) -> dict:  # noqa: ANN001
    """What a device-path manager (a copier's) did since :func:`_arm`."""
    import mapoffload

    if manager.copier is None:
        return {}
    host = [t for _, t in manager.iter_cpu_weights()]
    return {"copied": manager.copier.stats().bytes - getattr(manager, "_test_copied", 0),
            "forwards": getattr(manager, "_test_forwards", None), "slots": manager.copier.slots,
            "layers": len(manager.layers), "layer_bytes": [manager.parts.layer_bytes(i) for i in range(len(manager.layers))],
            "param_bytes": [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in manager.layers],
            "host_mapped": all(mapoffload.MappedRegions().classify(host)), "host_bytes": sum(t.nbytes for t in host)}


def _arm(model) -> None:  # noqa: ANN001
    """Count the forwards from now on (a pre-hook on each device-path stack's first layer), and the copier's bytes."""
    handle = getattr(model, "mapoffload_handle", None)
    for m in handle.managers.values() if handle is not None else []:
        if m.copier is None:
            continue
        m._test_forwards = 0
        m._test_copied = m.copier.stats().bytes

        def count(*_args, m=m) -> None:  # noqa: ANN001
            m._test_forwards += 1

        m.layers[0].register_forward_pre_hook(count)


def _status() -> dict:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _corrupt(folder: str) -> None:
    root = os.path.join(folder, ".mapoffload-converted")
    for key in os.listdir(root):
        for name in os.listdir(os.path.join(root, key)):
            if name.startswith("part-"):
                with open(os.path.join(root, key, name), "r+b") as f:
                    f.truncate(16)  # a header that no longer fits the file


@contextlib.contextmanager
def _environment(env: dict) -> Iterator[None]:
    """``env`` in ``os.environ`` inside (the engine reads it in this process, and its workers inherit it)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _digests(folder: str) -> dict[str, str]:
    """sha256 of every file under the checkpoint ``folder``'s conversion root."""
    import hashlib

    root = os.path.join(folder, ".mapoffload-converted")
    out = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _update(folder: str, parts: list[str], model) -> int:  # noqa: ANN001
    """Load the negated checkpoint tensors whose names hold one of ``parts`` into ``model`` (in the worker)."""
    import torch
    from safetensors.torch import load_file

    new = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            new.update({k: -t for k, t in load_file(os.path.join(folder, name)).items() if any(p in k for p in parts)})
    with torch.no_grad():
        model.load_weights(iter(new.items()))
    return len(new)


def _updated(llm, spec: dict, sampling) -> dict:  # noqa: ANN001
    """What :func:`_update` changed: tokens generated after it, the conversion folders' files before and after."""
    import functools

    from vllm.inputs import TokensPrompt

    before = _digests(spec["folder"])
    count = llm.apply_model(functools.partial(_update, spec["folder"], spec["update"]))[0]
    after = _digests(spec["folder"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sampling, use_tqdm=False)
    return {"updated": count, "conversion_digests": [before, after],
            "tokens_after_update": [list(o.outputs[0].token_ids) for o in outs]}


def _reloaded(llm, reload: dict, prompts: list, sampling) -> list:  # noqa: ANN001
    """vLLM's ``reload_weights`` from ``reload["folder"]``: its tensors as an iterator (RLHF weight transfer's
    path), or from disk (``weights_path``) with ``"from": "disk"``; the tokens generated after it."""
    from safetensors.torch import load_file
    from vllm.inputs import TokensPrompt

    folder = reload["folder"]
    if reload.get("from") == "disk":
        kwargs = {"weights_path": folder}
    else:
        kwargs = {"weights_iterator": list(load_file(os.path.join(folder, "model.safetensors")).items()),
                  "is_checkpoint_format": True}
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run(spec: dict) -> dict:
    with _environment(spec.get("env") or {}):
        return _run(spec)


def _run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    if spec.get("before") == "corrupt":
        _corrupt(spec["folder"])
    kwargs = dict(spec.get("engine") or {})
    if spec.get("extra") is not None:
        kwargs["model_loader_extra_config"] = spec["extra"]
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs.update(tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp")
    llm = LLM(model=spec["folder"], skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
              enforce_eager=kwargs.pop("enforce_eager", True), max_model_len=128, load_format=spec["load_format"],
              seed=0, **kwargs)
    try:
        sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=1)
        result = {"tokens": [], "logprobs": [], "after_init": _status()}
        llm.apply_model(_arm)
        read = _read_bytes()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sp, use_tqdm=False)
        result["read_bytes"] = _read_bytes() - read
        result["after_generate"] = _status()
        for o in outs:
            c = o.outputs[0]
            result["tokens"].append(list(c.token_ids))
            result["logprobs"].append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
        ranks = llm.apply_model(_where)
        result["where"] = ranks[0]
        result["ranks"] = ranks
        if spec.get("update"):
            result.update(_updated(llm, spec, sp))
        if spec.get("reload"):
            result["tokens_after_reload"] = _reloaded(llm, spec["reload"], spec["prompts"], sp)
        if spec.get("hold"):  # a file path: say so, and keep the engine up until the file exists
            sys.stdout.write("HOLD " + json.dumps(result) + "\n")
            sys.stdout.flush()
            while not os.path.exists(spec["hold"]):
                time.sleep(0.1)
        return result
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> None:
    spec = json.load(sys.stdin)
    results = {}
    for r in spec["runs"]:
        try:
            results[r["name"]] = run(r)
        except Exception as exc:  # reported per run: one failing engine does not hide the others
            traceback.print_exc()  # the stderr a failing test shows
            results[r["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write("RESULTS " + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
