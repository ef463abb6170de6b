"""``mapoffload convert``: do a checkpoint's load-time conversions ahead of time.

transformers converts some checkpoints as it loads them (experts fused into
3-D tensors, a dtype other than the stored one, fp8 dequantized without a
GPU). :func:`convert_pretrained` runs that load once through
:func:`~mapoffload.hf.transformers.load_pretrained`, so the converted tensors
are written into the conversion folder that every later load of the same
folder (same dtype, same versions) maps instead of converting again.
"""

from __future__ import annotations

import os
from typing import Any

import json

from .._checks import check_cache_dir, user_path
from ..loading.files import CheckpointError, NotLocalError, looks_remote, open_regular
from ..loading.report import LoadReport
from ._args import DTYPE_NAMES, check_dtype
from ._extras import require

__all__ = ["DTYPE_NAMES", "check_dtype", "check_model_folder", "convert_pretrained", "model_class_for", "named_class"]

_CONFIG_READ_LIMIT = 64 << 20  # a config.json larger than this is not one


def _read_json(path: str) -> Any:
    with open_regular(path) as (f, _):  # never blocks on a FIFO
        text = f.read(_CONFIG_READ_LIMIT + 1)
    if len(text) > _CONFIG_READ_LIMIT:
        raise CheckpointError(path, "is too large for a config file")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(path, f"is not JSON ({exc})") from None


def check_model_folder(folder: str) -> None:
    """Refuse, saying what it is and what to do instead, anything but a local transformers model
    folder: a missing path, a hub id, a file, a diffusers pipeline or model folder, a folder
    without config.json. Reads no weight."""
    if not os.path.exists(folder):
        if looks_remote(folder):
            raise NotLocalError(folder, what="mapoffload convert", kind="folder")
        raise FileNotFoundError(f"no such folder: {folder} (convert takes the local folder save_pretrained "
                                "wrote: config.json beside its weight files)")
    if not os.path.isdir(folder):
        raise CheckpointError(folder, "is a file, not a model folder: give the folder save_pretrained wrote "
                              "(config.json beside its weight files)")
    index = os.path.join(folder, "model_index.json")
    if os.path.lexists(index):
        data = _read_json(index)
        parts = [os.path.join(folder, name) for name, spec in sorted(data.items())
                 if isinstance(spec, list) and spec[:1] == ["transformers"]
                 and os.path.isfile(os.path.join(folder, name, "config.json"))] if isinstance(data, dict) else []
        which = (f"convert one of its transformers component folders ({', '.join(parts)}), or " if parts else "")
        raise CheckpointError(folder, f"is a diffusers pipeline folder (model_index.json): {which}load the whole "
                              "pipeline with mapoffload.pipeline_from_pretrained, which converts what it needs as "
                              "it loads")
    config = os.path.join(folder, "config.json")
    if not os.path.lexists(config):
        raise CheckpointError(folder, "no config.json: not a transformers model folder (give the folder "
                              "save_pretrained wrote: config.json beside its weight files)")
    data = _read_json(config)
    if not isinstance(data, dict):
        raise CheckpointError(config, f"holds a JSON {type(data).__name__}, not a model config")
    if "_diffusers_version" in data or ("_class_name" in data and "model_type" not in data):
        raise CheckpointError(folder, f"is a diffusers model folder (config.json names "
                              f"{data.get('_class_name', 'a diffusers class')}): mapoffload convert converts "
                              "transformers model folders; load its pipeline with "
                              "mapoffload.pipeline_from_pretrained, which converts what it needs as it loads")


def model_class_for(folder: str | os.PathLike, config: Any = None) -> Any:
    """The transformers class ``config.json`` names (``architectures[0]``), else ``AutoModel``."""
    transformers = require("transformers", "mapoffload convert")
    if config is None:
        config = transformers.AutoConfig.from_pretrained(os.fspath(folder))
    for name in getattr(config, "architectures", None) or ():
        if not isinstance(name, str):
            raise CheckpointError(os.path.join(os.fspath(folder), "config.json"),
                                  f"\"architectures\" holds {json.dumps(name)}, not a class name: correct it, or "
                                  "name the class (--class, cls=)")
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def named_class(name: str) -> Any:
    """The transformers model class called ``name`` (``"LlamaForCausalLM"``, ``"AutoModelForCausalLM"``).

    Raises ValueError for a name transformers has no model class by.
    """
    transformers = require("transformers", "mapoffload convert")
    found = getattr(transformers, name, None) if name.isidentifier() else None
    if not isinstance(found, type) or found is transformers.PreTrainedModel or not (
            hasattr(found, "_model_mapping") or issubclass(found, transformers.PreTrainedModel)):
        raise ValueError(f"{name!r} is not a transformers model class: name one such as LlamaForCausalLM, "
                         "or an Auto class such as AutoModelForCausalLM (default: config.json's architectures)")
    if name.endswith("PreTrainedModel"):  # a model type's base (LlamaPreTrainedModel): transformers cannot build it
        raise ValueError(f"{name!r} is the base class of a model type's classes, not a model: name one such as "
                         f"{name.removesuffix('PreTrainedModel')}ForCausalLM or {name.removesuffix('PreTrainedModel')}"
                         "Model, or leave the class out (config.json's architectures)")
    return found


def convert_pretrained(folder: str | os.PathLike, *, dtype: Any = "auto", cache_dir: str | os.PathLike | None = None,
                       cls: Any = None) -> LoadReport:
    """Load ``folder`` once so that its conversions are on disk; returns the load's report.

    ``cls`` is the class later loads pass to ``from_pretrained`` (a class or its name; an Auto
    class counts as the class it resolves to, so ``AutoModelForCausalLM`` and
    ``LlamaForCausalLM`` share one conversion); default: ``config.json``'s ``architectures``.
    ``~`` in ``folder`` and ``cache_dir`` is the home folder.

    Raises
    ------
    ValueError
        Before anything loads, for a dtype not in :data:`DTYPE_NAMES`, a class name transformers
        has no model class by (or ``PreTrainedModel``, the base of them all), a class of another
        model type than the folder's, an empty ``cache_dir``, or a hub id.
    FileNotFoundError
        For a missing local path.
    CheckpointError
        For a file, a diffusers pipeline or model folder, a folder without config.json, a
        config.json whose ``architectures`` holds something else than class names.
    ConversionWriteError
        When the conversion cannot be written (:mod:`mapoffload.conversion`).
    """
    from . import transformers as hf_transformers

    check_dtype(dtype)
    cache_dir = check_cache_dir(cache_dir)
    folder = user_path(folder, "folder")
    check_model_folder(folder)
    if isinstance(cls, str):
        cls = named_class(cls)
    cls = cls or model_class_for(folder)
    mismatch = hf_transformers.folder_model_mismatch(cls, folder)
    if mismatch is not None:  # from_pretrained's TypeError, said for this command
        raise ValueError(f"{mismatch}: name its own class (config.json's architectures, the default) or an "
                         "Auto class such as AutoModelForCausalLM")
    model, report = hf_transformers.load_pretrained(cls, folder, dtype=dtype, cache_dir=cache_dir)
    del model
    return report
