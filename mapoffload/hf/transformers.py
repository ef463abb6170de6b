"""``mapoffload.from_pretrained``: a transformers model from a local folder,
built on meta in the checkpoint's dtype, loaded on the file mapping with the
Hugging Face key conventions, in eval mode, offloaded onto a device."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from .._files import checkpoint_files
from .._log import logger
from ..checkpoint import LoadReport, empty_weights, load_checkpoint
from . import _keys
from ._extras import require

if TYPE_CHECKING:
    import torch

    from .offload import OffloadHandle

__all__ = ["KeyMismatchError", "from_pretrained", "load_pretrained"]


class KeyMismatchError(ValueError):
    """A checkpoint's keys do not match the model (with ``strict=True``)."""


def _resolve_dtype(dtype: Any, keys: _keys.CheckpointKeys, config: Any) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        value = getattr(torch, str(dtype), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype must be 'auto', a torch.dtype or its name, not {dtype!r}")
        return value
    stored = _keys.checkpoint_float_dtype(keys)
    if stored is not None:
        configured = getattr(config, "dtype", None)
        if configured is not None and str(configured).removeprefix("torch.") != stored:
            logger.info("config says dtype %s, the checkpoint stores %s: building in %s (no conversion)",
                        configured, stored, stored)
        return getattr(torch, stored)
    configured = getattr(config, "dtype", None)
    if isinstance(configured, torch.dtype):
        return configured
    if isinstance(configured, str) and isinstance(getattr(torch, configured, None), torch.dtype):
        return getattr(torch, configured)
    return torch.get_default_dtype()


def _is_auto(cls: Any) -> bool:
    return hasattr(cls, "_model_mapping")


def _build(cls: Any, config: Any, dtype: torch.dtype, kwargs: dict) -> torch.nn.Module:
    """The model with parameters on meta (buffers real, from its own init), in ``dtype``."""
    with empty_weights():
        if _is_auto(cls):
            return cls.from_config(config, dtype=dtype, **kwargs)
        return cls._from_config(config, dtype=dtype, **kwargs)


def _keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Parameters the model keeps in float32 under ``dtype`` (``_keep_in_fp32_modules``
    for fp16, ``_keep_in_fp32_modules_strict`` for fp16/bf16), rebuilt on meta
    in float32 as transformers does. Returns how many."""
    import re

    import torch

    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return 0
    pattern = re.compile("|".join(rf"(^|\.){re.escape(str(k))}(\.|$)" for k in plan))
    done: dict[int, torch.nn.Parameter] = {}
    for name, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            full = f"{name}.{attr}" if name else attr
            if p is None or not p.is_floating_point() or not pattern.search(full):
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="meta"),
                                                 requires_grad=p.requires_grad)
            module._parameters[attr] = done[id(p)]
    return len(done)


def _tie_groups(module: torch.nn.Module) -> dict[str, list[str]]:
    """Parameter name -> every name of that parameter object (ties)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def _materialise_missing(model: torch.nn.Module, missing: list[str]) -> None:
    """Give parameters the checkpoint lacks real memory, initialised by the
    model's own ``_init_weights`` (as transformers does for missing keys)."""
    import torch

    done: dict[int, torch.nn.Parameter] = {}
    owners = []
    for name in missing:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        p = owner._parameters.get(attr)
        if p is None or p.device.type != "meta":
            continue
        if id(p) not in done:
            done[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        owner._parameters[attr] = done[id(p)]
        owners.append(owner)
    init = getattr(model, "_init_weights", None)
    if init is None:
        return
    with torch.no_grad():
        for owner in {id(o): o for o in owners}.values():
            init(owner)  # other parameters of the module are still on meta: untouched


def load_pretrained(
    cls: Any,
    folder: str | os.PathLike,
    *,
    dtype: Any = "auto",
    keep_mapping: bool | None = None,
    strict: bool = False,
    config: Any = None,
    **model_kwargs: Any,
) -> tuple[torch.nn.Module, LoadReport]:
    """Build and load a transformers model from ``folder`` (no offload).

    See :func:`from_pretrained`; returns the model (in eval mode) and the
    :class:`~mapoffload.LoadReport`.
    """
    transformers = require("transformers", "mapoffload.from_pretrained")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"{folder!r} is not a local folder: mapoffload.from_pretrained loads local folders only "
            "(download first, e.g. huggingface_hub.snapshot_download, and pass its path)"
        )
    if config is None:
        config_cls = transformers.AutoConfig if _is_auto(cls) else getattr(cls, "config_class", None)
        config = (config_cls or transformers.AutoConfig).from_pretrained(folder)
    files = checkpoint_files(folder)
    keys = _keys.read_keys(files)
    torch_dtype = _resolve_dtype(dtype, keys, config)
    model = _build(cls, config, torch_dtype, model_kwargs)
    kept_fp32 = _keep_in_fp32(model, torch_dtype)
    if kept_fp32:
        logger.info("%s keeps some modules in float32 under %s, as transformers does", type(model).__name__,
                    torch_dtype)

    import torch

    ckpt_keys = set(keys.shapes)
    rule, prefix = _keys.prefix_rule(model, ckpt_keys, set(model.state_dict().keys()))

    if rule == "strip":  # a `bert.`-prefixed checkpoint into BertModel
        target = torch.nn.Module()
        target.add_module(prefix, model)
    elif rule == "add":  # a base checkpoint into a model with a head
        target = getattr(model, prefix)
    else:
        target = model
    target_state = set(target.state_dict().keys())
    ties = _tie_groups(target)
    # Missing, in the target's names (a tied name is covered by any of its group).
    missing = sorted(k for k in target_state - ckpt_keys if not any(n in ckpt_keys for n in ties.get(k, [k])))
    unexpected = sorted(ckpt_keys - target_state)

    def model_name(k: str) -> str:  # target name -> the model's own name
        if rule == "strip":
            return k[len(prefix) + 1:] if k.startswith(prefix + ".") else k
        return f"{prefix}.{k}" if rule == "add" else k

    missing = [model_name(k) for k in missing]
    if rule == "add":  # the head outside the base model is missing too
        base = {id(p) for p in target.parameters()}
        missing += sorted(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in base)
    ignore_missing, ignore_unexpected = _keys.ignore_patterns(model)
    unexpected_shown = [k for k in unexpected if not (ignore_unexpected and ignore_unexpected.search(model_name(k)))]
    missing_shown = [k for k in missing if not (ignore_missing and ignore_missing.search(k))]
    problems = []
    if rule != "same":
        logger.info("%s: checkpoint keys %s the %r prefix of %s", folder,
                    "lose" if rule == "strip" else "gain", prefix, type(model).__name__)
    if missing_shown:
        problems.append(_keys.describe_keys("missing", missing_shown)
                        + " (initialised as the model's _init_weights does)")
    if unexpected_shown:
        problems.append(_keys.describe_keys("unexpected", unexpected_shown) + " (not loaded)")
    if problems:
        message = f"{folder} into {type(model).__name__}: " + "; ".join(problems)
        if strict:
            raise KeyMismatchError(message)
        warnings.warn(message, stacklevel=3)
    _materialise_missing(model, missing)
    report = load_checkpoint(target, folder, keep_mapping=keep_mapping, strict=False)
    if rule == "strip":
        del target._modules[prefix]
    converted = report.copied.get("dtype", 0)
    if converted:
        now = {k: str(v.dtype).removeprefix("torch.") for k, v in target.state_dict().items()}
        pairs = sorted({(keys.dtypes[k], now[k]) for k in ckpt_keys if k in now and keys.dtypes[k] != now[k]})
        warnings.warn(_keys.describe_conversion(converted, pairs, kept_fp32 > 0, folder), stacklevel=3)
    model.tie_weights()
    model.eval()
    return model, report


def from_pretrained(
    cls: Any,
    folder: str | os.PathLike,
    *,
    device: str | torch.device | None,
    dtype: Any = "auto",
    keep_mapping: bool | None = None,
    strict: bool = False,
    config: Any = None,
    layers: Any = "auto",
    rest: str = "auto",
    prefetch_layers: int = 1,
    host_store: str | None = None,
    **model_kwargs: Any,
) -> torch.nn.Module:
    """A transformers model from a local folder, on the file mapping, offloaded onto ``device``.

    Parameters
    ----------
    cls
        A model class (``LlamaForCausalLM``) or an ``AutoModel*`` class.
    folder
        A local folder written by ``save_pretrained`` (``config.json`` and
        safetensors files, sharded or not).
    device
        Where the model runs (``"cuda"``, ``"cuda:N"``, ``"cpu"``); its block
        lists are streamed there by :func:`mapoffload.offload`. None: no
        offload (the loaded model on the host).
    dtype
        ``"auto"``: the dtype the checkpoint stores (from the safetensors
        headers; ``config.dtype`` for other files) — nothing is converted.
        Another dtype converts (a warning says how many bytes).
    keep_mapping
        None: with ``device`` the weights stay on the file mapping (the
        offload then chooses each stack's host store against the budget —
        pinned copies where they pay, on CUDA — so a copy at load time would
        only be made twice); without ``device`` the gate decides
        (:func:`~mapoffload.keep_checkpoint_mapped`). True keeps every
        matching tensor on the file mapping; False copies.
    strict
        Missing or unexpected keys (beyond the model's ignore lists) raise
        :class:`KeyMismatchError` instead of a warning.
    layers, rest, prefetch_layers, host_store
        Passed to :func:`mapoffload.offload`.
    **model_kwargs
        Passed to the model's constructor (``attn_implementation=...``).

    Returns
    -------
    torch.nn.Module
        In eval mode. ``model.mapoffload_report`` is the
        :class:`~mapoffload.LoadReport`, ``model.mapoffload_handle`` the
        :class:`OffloadHandle` (``summary()``, ``close()``) or None.
    """
    from .offload import offload

    if keep_mapping is None and device is not None:
        keep_mapping = True
    model, report = load_pretrained(cls, folder, dtype=dtype, keep_mapping=keep_mapping, strict=strict,
                                    config=config, **model_kwargs)
    handle: OffloadHandle | None = None
    if device is not None:
        handle = offload(model, device=device, layers=layers, rest=rest, prefetch_layers=prefetch_layers,
                         host_store=host_store)
    object.__setattr__(model, "mapoffload_report", report)
    object.__setattr__(model, "mapoffload_handle", handle)
    return model
