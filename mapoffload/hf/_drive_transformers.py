"""The hooks that drive transformers' own loader (:mod:`._drive`).

Five places of transformers' loading are wrapped for one load:
``modeling_utils._get_resolved_checkpoint_files`` (the files it reads: checked against
those the conversion is keyed on, :func:`check_resolved`),
``WeightConverter.convert`` / ``WeightRenaming.convert`` (a conversion is about
to make its outputs: the session closes the previous one, and keeps the fp8
codes and scales of a dequantizing converter's inputs to run its later ops on
them), ``core_model_loading.set_param_for_module`` (each final tensor set into
the model, recorded), ``modeling_utils.convert_and_load_state_dict_in_model``
(the whole load: a reused conversion's tensors put in place of the checkpoint
keys they were made from, the session finished) and the ``is_env_variable_true``
that ``core_model_loading`` reads its switch for loader threads with (switched
off for this thread's load only; the environment is never written). Outside a
session each wrapper calls transformers' own function untouched.
"""

from __future__ import annotations

import os
from typing import Any

from .._log import logger
from ._drive import FP8_PART, _session, stale_tensors

SYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"  # transformers' switch for its loader threads


def _dequantizes_fp8(converter: Any) -> bool:
    ops = getattr(converter, "operations", None) or []
    return len(ops) > 1 and type(ops[0]).__name__ == "Fp8Dequantize"


def _resolved(item: Any) -> Any:
    """A collected tensor: a Future (async loading), a callable (sync) or a tensor."""
    if hasattr(item, "result"):
        return item.result()
    return item() if callable(item) else item


def _scale_source_of(weight_pattern: str) -> str:
    """The source pattern a dequantizing converter collects a weight's block
    scales under, as ``Fp8Dequantize`` pairs them: ``<w>.weight`` ->
    ``<w>.weight_scale_inv``. transformers 5.19 anchors both with a regex
    ``$`` (``.experts.*.w1.weight$`` / ``.experts.*.w1.weight_scale_inv$``: its
    ``FineGrainedFP8HfQuantizer.update_weight_conversions``, paired back by
    ``Fp8Dequantize._scale_pattern_for``); 5.24 does not (``f"{key}_scale_inv"``).
    The anchor is kept where it is, so the keys stay the ones the converter's
    later ops are given."""
    base, anchor = (weight_pattern[:-1], "$") if weight_pattern.endswith("$") else (weight_pattern, "")
    return f"{base}_scale_inv{anchor}"


def _fused_fp8(converter: Any, inputs: dict[str, list[Any]], layer_name: str, kwargs: dict) -> Any:
    """The converter's ops after ``Fp8Dequantize`` (stack the experts, join
    gate and up) run by transformers on the fp8 codes, and again on the block
    scales: ``(codes, scales)`` of the one tensor it makes, or None."""
    # a source pattern's name without its regex anchor: a scale (`_scale_inv`), an unused activation scale (`_scale`)
    def is_scale(k: str) -> bool:
        return k.removesuffix("$").endswith(("_scale_inv", "_scale"))

    codes = {k: [_resolved(t) for t in v] for k, v in inputs.items() if not is_scale(k)}
    # in the weights' order, under the weights' keys: the ops join them in that order
    scales = {k: [_resolved(t) for t in inputs[_scale_source_of(k)]] for k in codes if _scale_source_of(k) in inputs}
    if not codes or codes.keys() != scales.keys():
        logger.info("fp8 codes of %s cannot be kept (sources %s not paired with scales): dequantized",
                    layer_name, sorted(inputs))
        return None
    out = []
    for tensors in (codes, scales):
        for op in converter.operations[1:]:
            tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                                 target_patterns=converter.target_patterns, full_layer_name=layer_name,
                                 model=kwargs.get("model"), config=kwargs.get("config"), missing_keys=None)
        if len(tensors) != 1:
            return None
        out.append(next(iter(tensors.values())))
    return tuple(out)


def check_resolved(files: list[str] | None, expected: list[str]) -> None:
    """Refuse a load whose checkpoint files (as transformers resolved them) are not among
    ``expected``, those its conversion is keyed on
    (:func:`~mapoffload.loading.files.pretrained_files`): a conversion made from other files
    would be reused for changed ones. Compared by real path."""
    from ..loading.files import CheckpointError

    want = {os.path.realpath(f) for f in expected}
    other = sorted(f for f in (files or []) if os.path.realpath(f) not in want)
    if files is None or other:
        where = os.path.dirname(expected[0]) if expected else "?"
        read = ", ".join(other) if files is not None else "files of its own (not its checkpoint resolution)"
        raise CheckpointError(where, f"transformers reads {read}, where mapoffload expected "
                                     f"{', '.join(os.path.basename(f) for f in expected)}: refused, since a "
                                     "conversion keyed on other files could be reused stale (please report it)")


def _wrap_resolve(original):
    def _get_resolved_checkpoint_files(*args, **kwargs):
        result = original(*args, **kwargs)
        s = _session()
        if s is not None and s.files is not None:
            files = result[0] if isinstance(result, tuple) else None
            check_resolved(files, s.files)
            s.resolved = list(files or [])
        return result

    _get_resolved_checkpoint_files.__wrapped__ = original
    return _get_resolved_checkpoint_files


def _wrap_convert(original):
    def convert(self, *args, **kwargs):
        s = _session()
        inputs = None
        if s is not None:
            sources = {k for keys in getattr(self, "layer_targets", {}).values() for k in keys}
            s.start_group(sources)
            if s.keep_fp8 and _dequantizes_fp8(self):  # before transformers takes them
                inputs = {k: list(v) for k, v in self.collected_tensors.items()}
        result = original(self, *args, **kwargs)
        if inputs is not None:
            try:
                s.fp8_fused = _fused_fp8(self, inputs, args[0] if args else kwargs.get("layer_name", ""), kwargs)
            except (RuntimeError, ValueError, TypeError) as exc:  # an op that cannot take fp8: dequantize instead
                logger.info("fp8 codes of %s cannot be kept (%s): dequantized", args[0] if args else "?", exc)
        return result

    convert.__wrapped__ = original
    return convert


def _wrap_set_param(original):
    def set_param_for_module(model, target_name, param_value, loading_info, hf_quantizer):
        original(model, target_name, param_value, loading_info, hf_quantizer)
        s = _session()
        if s is not None:
            module_path, _, attr = target_name.rpartition(".")
            module = model.get_submodule(module_path) if module_path else model
            if attr in module._parameters or attr in module._buffers:
                s.record(target_name, module, attr)

    set_param_for_module.__wrapped__ = original
    return set_param_for_module


def _wrap_load(original):
    def convert_and_load_state_dict_in_model(model, state_dict, load_config, *args, **kwargs):
        s = _session()
        if s is None:
            return original(model, state_dict, load_config, *args, **kwargs)
        s.loads += 1
        if s.files is not None and s.resolved is None:  # weights from elsewhere (a distributed checkpoint)
            check_resolved(None, s.files)
        fp8: dict[str, dict[str, Any]] = {}
        reused: dict[str, Any] = {}
        if s.cache.reused:
            consumed = s.cache.consumed_sources()
            state_dict = {k: v for k, v in state_dict.items() if k not in consumed}
            for name, tensor in s.cache.mapped().items():
                target, _, part = name.partition(FP8_PART)
                if part:  # fp8 codes / scales of a weight: attached below, not a key transformers knows
                    fp8.setdefault(target, {})[part] = tensor
                else:
                    state_dict[name] = reused[name] = tensor
        s.regions = s.snapshot()  # the checkpoint's files are open (mapped) by now
        s.sources = state_dict
        result = original(model, state_dict, load_config, *args, **kwargs)  # one by one: see _wrap_env
        s.stale += stale_tensors(model, reused)  # once per shard: every call counts
        s.finish()
        s.sources = None
        info = result[0] if isinstance(result, tuple) else result
        if fp8:
            _attach_cached_fp8(model, fp8, info)
        s.conversion_errors.update(getattr(info, "conversion_errors", None) or {})
        return result

    convert_and_load_state_dict_in_model.__wrapped__ = original
    return convert_and_load_state_dict_in_model


def _wrap_env(original):
    """transformers' loader threads would make every cast or dequantized tensor ahead of the loop
    that sets them (the whole model in anonymous memory): in this thread's load they are made one by
    one, as ``HF_DEACTIVATE_ASYNC_LOAD=1`` asks, without setting it in the environment, which every
    thread reads (another thread's plain transformers load keeps its threads)."""
    def is_env_variable_true(name, *args, **kwargs):
        if name == SYNC_LOAD and _session() is not None:
            return True
        return original(name, *args, **kwargs)

    is_env_variable_true.__wrapped__ = original
    return is_env_variable_true


def _attach_cached_fp8(model: Any, cached: dict[str, dict[str, Any]], info: Any) -> None:
    """Weights a reused conversion holds as fp8 codes and scales: attached to
    the (still meta) parameters they stand for, which transformers then counts
    as loaded."""
    from ..loading.fp8 import attach_fp8

    for target, parts in cached.items():
        if set(parts) != {"fp8_codes", "fp8_scale"}:
            raise KeyError(f"conversion cache: {target} lacks its fp8 codes or scales")
        owner_path, _, attr = target.rpartition(".")
        module = model.get_submodule(owner_path) if owner_path else model
        held = module._parameters.get(attr)
        if held is None:
            raise KeyError(f"conversion cache: {target} is not a parameter of {type(model).__name__}")
        attach_fp8(module, attr, parts["fp8_codes"], parts["fp8_scale"], dtype=held.dtype)
        plist = module.parametrizations[attr]
        plist.original._is_hf_initialized = True
        plist[0].scale._is_hf_initialized = True
        missing = getattr(info, "missing_keys", None)
        if missing is not None:
            missing.discard(target)


def transformers_hooks() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, wrapper factory) for transformers' loading."""
    from transformers import core_model_loading as cml
    from transformers import modeling_utils as mu

    return [
        (mu, "_get_resolved_checkpoint_files", _wrap_resolve),
        (cml, "set_param_for_module", _wrap_set_param),
        (mu, "convert_and_load_state_dict_in_model", _wrap_load),
        (cml, "is_env_variable_true", _wrap_env),
        (cml.WeightConverter, "convert", _wrap_convert),
        (cml.WeightRenaming, "convert", _wrap_convert),
    ]
