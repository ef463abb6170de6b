"""The arguments of the Hugging Face entry points, checked where they enter.

Each refusal is one line naming the argument, what is wrong with it and the
fix, raised before anything is loaded: a newcomer's mistake (``layers=5``,
the class named as a string, a file for its folder) must not surface as an
``AttributeError`` from deep inside transformers, or after a long load.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

from ..loading.files import NotLocalError, looks_remote

# The dtypes a conversion can be made for, by name: 'auto' is transformers 5's default (the
# config's dtype, else the checkpoint's).
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32", "float64")
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
                  "fp64": "float64", "double": "float64"}


def check_dtype(dtype: Any) -> None:
    """Refuse a dtype a conversion cannot be made for (before anything is loaded): one of
    :data:`DTYPE_NAMES` or the torch dtype it names."""
    if isinstance(dtype, str):
        if dtype in DTYPE_NAMES:
            return
    elif type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        if str(dtype).removeprefix("torch.") in DTYPE_NAMES:
            return
    hint = _DTYPE_ALIASES.get(str(dtype).removeprefix("torch.").lower())
    raise ValueError(f"dtype {dtype!r} is not one a conversion takes: {', '.join(DTYPE_NAMES)} (or that torch "
                     f"dtype){f'; did you mean {hint!r}?' if hint else ''}")


def check_folder(folder: Any, what: str, *, beside: str) -> str:
    """``folder`` as a path to a local folder, or a one-line error.

    Parameters
    ----------
    what
        The entry point, for the message (``"mapoffload.from_pretrained"``).
    beside
        What the folder holds, for the message (``"config.json beside the weights"``).

    Raises
    ------
    TypeError
        Not a path.
    ValueError
        A file: the folder that holds it is named.
    FileNotFoundError
        Nothing there: a hub id is told to be downloaded first, a local path is missing.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path (str or os.PathLike), not {type(folder).__name__}")
    from .._checks import user_path

    path = user_path(folder, "folder")  # `~/models/x` as a keyword: no shell expanded it
    if os.path.isfile(path):
        raise ValueError(f"{path!r} is a file: {what} takes the folder save_pretrained wrote ({beside}): "
                         f"pass {os.path.dirname(os.path.abspath(path))!r}")
    if not os.path.isdir(path):
        if looks_remote(path):
            raise NotLocalError(path, what=what, kind="folder")
        raise FileNotFoundError(f"no such folder: {path}")
    return path


def check_model_class(cls: Any, what: str) -> None:
    """``cls`` must be a transformers model class (``PreTrainedModel`` or ``AutoModel*``)."""
    import torch
    import transformers

    if isinstance(cls, str):
        name = cls.rsplit(".", 1)[-1]
        fix = (f"pass transformers.{name}" if isinstance(getattr(transformers, name, None), type)
               else "pass the class itself, e.g. transformers.AutoModelForCausalLM")
        raise TypeError(f"{what} takes a model class, not the string {cls!r}: {fix}")
    if not isinstance(cls, type):
        if isinstance(cls, torch.nn.Module):
            raise TypeError(f"{what} takes a model class, not a built {type(cls).__name__}: pass its class "
                            f"({type(cls).__name__}) to load the folder, or stream this one with "
                            "mapoffload.offload(model, device=...)")
        raise TypeError(f"{what} takes a model class, not {type(cls).__name__} ({cls!r})")
    if issubclass(cls, transformers.PretrainedConfig) or cls is transformers.AutoConfig:
        raise TypeError(f"{cls.__name__} is a configuration class: pass a model class (such as "
                        "transformers.AutoModelForCausalLM), and the configuration as config=")
    if cls is transformers.PreTrainedModel:
        raise TypeError("transformers.PreTrainedModel is the base of every model class, not a model: pass the "
                        "folder's class (such as transformers.LlamaForCausalLM) or an AutoModel* class")
    if not (issubclass(cls, transformers.PreTrainedModel) or hasattr(cls, "_model_mapping")):
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not a transformers model class (a PreTrainedModel "
                        "subclass or an AutoModel* class): for another nn.Module build it under "
                        "mapoffload.empty_weights() and use mapoffload.load_checkpoint")


def check_pipeline_class(cls: Any, what: str) -> None:
    """``cls`` must be a diffusers pipeline class (or ``DiffusionPipeline``)."""
    import diffusers

    if isinstance(cls, str):
        name = cls.rsplit(".", 1)[-1]
        fix = (f"pass diffusers.{name}" if isinstance(getattr(diffusers, name, None), type)
               else "pass the class itself, e.g. diffusers.DiffusionPipeline")
        raise TypeError(f"{what} takes a pipeline class, not the string {cls!r}: {fix}")
    if not isinstance(cls, type):
        raise TypeError(f"{what} takes a pipeline class, not a built {type(cls).__name__}: pass its class, or "
                        "stream this one with mapoffload.offload_pipeline(pipe, device=...)")


def check_flags(*, keep_mapping: Any = None, strict: Any = False) -> None:
    """``keep_mapping`` True/False/None and ``strict`` True/False: a string would read as True."""
    if keep_mapping is not None and not isinstance(keep_mapping, bool):
        raise TypeError(f"keep_mapping must be True, False or None (the gate), not {keep_mapping!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, not {strict!r}")


def keyword_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The keyword-only parameters of ``fn`` (an entry point's own keywords)."""
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
