"""The hooks that drive diffusers' own model loader (:mod:`._drive`).

diffusers' models set each tensor through one call (accelerate's
``set_module_tensor_to_device``): each is recorded as a conversion of its own
key, so one not on a mapping (a cast) is written out and mapped. Its
``load_model_dict_into_meta`` (the whole state dict) is wrapped to put a
reused conversion's tensors in place and finish the session. Outside a
session each wrapper calls diffusers' own function untouched.
"""

from __future__ import annotations

from typing import Any

from ._drive import _session, stale_tensors


def _wrap_set_tensor(original):
    """diffusers (through accelerate) sets each tensor with one call; a cast or
    conversion made it when it is not on a mapping. Its source is its own key."""

    def set_module_tensor_to_device(module, tensor_name, *args, **kwargs):
        result = original(module, tensor_name, *args, **kwargs)
        s = _session()
        if s is not None:
            owner_path, _, attr = tensor_name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            s.start_group({tensor_name})
            s.record(tensor_name, owner, attr)
        return result

    set_module_tensor_to_device.__wrapped__ = original
    return set_module_tensor_to_device


def _wrap_load_dict(original):
    def load_model_dict_into_meta(model, state_dict, *args, **kwargs):
        s = _session()
        if s is None:
            return original(model, state_dict, *args, **kwargs)
        s.loads += 1
        reused = {}
        if s.cache.reused:
            cached = s.cache.mapped()
            reused = {k: cached[k] for k in state_dict if k in cached}
            state_dict = type(state_dict)((k, cached.get(k, v)) for k, v in state_dict.items())
        s.regions = s.snapshot()
        result = original(model, state_dict, *args, **kwargs)
        s.stale += stale_tensors(model, reused)  # once per shard: every call counts
        s.finish()
        return result

    load_model_dict_into_meta.__wrapped__ = original
    return load_model_dict_into_meta


def diffusers_hooks() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, wrapper factory) for diffusers' model loading."""
    from diffusers.models import model_loading_utils as mlu
    from diffusers.models import modeling_utils as dmu

    if not hasattr(mlu, "set_module_tensor_to_device"):
        # diffusers imports it from accelerate when accelerate is installed, and
        # without it loads whole state dicts into memory: nothing to keep mapped.
        raise ImportError(
            "mapoffload's diffusers loading needs accelerate (diffusers sets each tensor through "
            "accelerate's set_module_tensor_to_device): pip install \"mapoffload[diffusers]\" or pip install accelerate"
        )
    hooks = [(mlu, "set_module_tensor_to_device", _wrap_set_tensor)]
    for owner in (mlu, dmu):
        if hasattr(owner, "load_model_dict_into_meta"):
            hooks.append((owner, "load_model_dict_into_meta", _wrap_load_dict))
    return hooks
