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

from .._files import CheckpointError
from ..checkpoint import LoadReport
from ._extras import require

__all__ = ["convert_pretrained", "model_class_for", "named_class"]


def model_class_for(folder: str | os.PathLike, config: Any = None) -> Any:
    """The transformers class ``config.json`` names (``architectures[0]``), else ``AutoModel``."""
    transformers = require("transformers", "mapoffload convert")
    if config is None:
        config = transformers.AutoConfig.from_pretrained(os.fspath(folder))
    for name in getattr(config, "architectures", None) or ():
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
    if not isinstance(found, type) or not (hasattr(found, "_model_mapping")
                                           or issubclass(found, transformers.PreTrainedModel)):
        raise ValueError(f"{name!r} is not a transformers model class: name one such as LlamaForCausalLM, "
                         "or an Auto class such as AutoModelForCausalLM (default: config.json's architectures)")
    return found


def convert_pretrained(folder: str | os.PathLike, *, dtype: Any = "auto", cache_dir: str | os.PathLike | None = None,
                       cls: Any = None) -> LoadReport:
    """Load ``folder`` once so that its conversions are on disk; returns the load's report.

    ``cls`` is the class later loads pass to ``from_pretrained`` (a class or its name; an Auto
    class counts as the class it resolves to, so ``AutoModelForCausalLM`` and
    ``LlamaForCausalLM`` share one conversion); default: ``config.json``'s ``architectures``.

    Raises :class:`~mapoffload.CheckpointError` when ``folder`` has no config.json.
    """
    from .transformers import load_pretrained

    folder = os.fspath(folder)
    if isinstance(cls, str):
        cls = named_class(cls)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(folder, "no config.json: not a transformers model folder")
    cls = cls or model_class_for(folder)
    model, report = load_pretrained(cls, folder, dtype=dtype, cache_dir=cache_dir)
    del model
    return report
