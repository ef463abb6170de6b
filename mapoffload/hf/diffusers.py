"""diffusers pipelines on the file mapping: ``mapoffload.pipeline_from_pretrained``
and ``mapoffload.offload_pipeline``.

Names, as a diffusers user looks for them: diffusers loads a pipeline with
``DiffusionPipeline.from_pretrained(folder)`` and offloads one with
``pipe.enable_model_cpu_offload()``; here ``pipeline_from_pretrained(cls, folder,
device=...)`` is the first (the class first, as in
:func:`mapoffload.from_pretrained`) and ``offload_pipeline(pipe, device=...)``
the second, for a pipeline the user already has.

Each model component of ``model_index.json`` is loaded by its own library's
``from_pretrained`` — diffusers models by diffusers (its key conversions,
``_keep_in_fp32_modules``), text encoders by
:func:`~mapoffload.hf.transformers.load_pretrained` — in the dtype its
checkpoint stores (``dtype="auto"``), with every weight left on the file
mapping: the checkpoint's own, or for what the loader casts or converts a
conversion folder written once and mapped. ``keep_mapping=False`` copies.
Offloading streams each component's block lists (:func:`find_block_lists`:
Flux's ``transformer_blocks`` + ``single_transformer_blocks``, SD3's
``transformer_blocks``, a text encoder's layers; a UNet's ``down_blocks`` and
``up_blocks``) and places the rest: one :class:`OffloadHandle` for the pipeline, one in its
``components`` per model component.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from typing import TYPE_CHECKING, Any

from .._checks import check_cache_dir
from ..loading.files import diffusers_files
from .._log import logger
from ..loading.report import LoadReport
from . import _keys
from ..offload.hooks import CallNames
from ..options import FIELDS, OffloadOptions, gather, load_options, shows_option_keywords, unexpected_keyword
from ._args import check_flags, check_folder, check_pipeline_class, keyword_names
from ..conversion import ConversionCache
from ..conversion import default_root, fingerprint
from ._drive import convert_again, driving
from ._drive_diffusers import diffusers_hooks
from ._report import Unsettled, settle
from ._extras import require
from .blocks import find_block_lists
from .offload import OffloadHandle, offload_with

if TYPE_CHECKING:
    import torch

__all__ = ["load_pipeline", "offload_pipeline", "pipeline_from_pretrained"]

WHAT = "mapoffload.pipeline_from_pretrained"

# diffusers' own from_pretrained arguments that mean something else here, with the answer.
_DIFFUSERS_HABITS = {
    "torch_dtype": "pass dtype= (a dtype, or a dict {component: dtype}; 'auto', the default, keeps each "
                   "component's stored dtype)",
    "device_map": "mapoffload places the pipeline itself: pass device='cuda' (or 'cpu')",
    "low_cpu_mem_usage": "mapoffload always loads on the file mapping (nothing to pass)",
}


def _stacks(model: torch.nn.Module) -> list[Any]:
    """The block lists worth streaming in one component (possibly none)."""
    import torch

    # A UNet's down/up blocks are lists of different classes (cross-attention
    # or not), which find_block_lists does not take for a stack: streamed as
    # two lists, the mid block placed with the rest.
    if all(isinstance(getattr(model, a, None), torch.nn.ModuleList) for a in ("down_blocks", "up_blocks")) \
            and hasattr(model, "mid_block"):
        return ["down_blocks", "up_blocks"]
    return [path for path, _ in find_block_lists(model)]


@shows_option_keywords
def offload_pipeline(pipe: Any, options: OffloadOptions | None = None, *, skip: tuple[str, ...] = (),
                     **keywords: Any) -> OffloadHandle:
    """Offload every model component of a diffusers pipeline onto the device.

    Each ``torch.nn.Module`` component (text encoders, denoiser, VAE) goes
    through :func:`mapoffload.offload`: its block lists streamed layer by
    layer, the rest placed on the device when it fits (streamed module by
    module when not). A component without a block list is placed whole, or
    streamed module by module when it does not fit.

    Parameters
    ----------
    pipe
        A ``DiffusionPipeline`` (any object with a ``components`` dict).
    options
        An :class:`~mapoffload.OffloadOptions` for every component (its
        ``layers`` stays ``"auto"``: each component's block lists are found).
    skip
        Component names left alone.
    **keywords
        The fields of :class:`~mapoffload.OffloadOptions`, laid over ``options``.

    Returns
    -------
    OffloadHandle
        Its ``components``: each model component's handle. Also ``pipe.mapoffload_handle`` while it is open (its ``close()`` sets it to None).
    """
    return offload_pipeline_with(pipe, gather("mapoffload.offload_pipeline", options, keywords, others=("skip",)),
                                 CallNames("handle.close()"), skip)


def offload_pipeline_with(pipe: Any, options: OffloadOptions, calls: CallNames,
                          skip: tuple[str, ...] = ()) -> OffloadHandle:
    """:func:`offload_pipeline` with checked ``options``; the placeholders' errors name ``calls``."""
    if options.layers != "auto":
        raise ValueError(f"layers={options.layers!r}: a pipeline's block lists are found in each component "
                         "(leave layers='auto'; offload one component with mapoffload.offload(component, layers=...))")
    import torch

    from ..offload.manager import less_copies

    handle = OffloadHandle(pipe, options)
    try:
        for name, component in pipe.components.items():
            if not isinstance(component, torch.nn.Module) or name in skip:
                continue
            # A budget given for the pipeline: what the components before made in copies is not this one's.
            given = less_copies(options, (m for h in handle.components.values() for m in h.managers.values()))
            handle.components[name] = offload_with(component, given.filled(layers=_stacks(component)), calls)
    except BaseException:
        handle.close()
        raise
    object.__setattr__(pipe, "mapoffload_handle", handle)  # the live handle (close() sets it to None)
    logger.info("offload of %s:\n%s", type(pipe).__name__, handle.summary())
    return handle


# --- loading ------------------------------------------------------------------------


def _resolve(dtype: Any, keys: _keys.CheckpointKeys) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        value = getattr(torch, str(dtype), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype must be 'auto', a torch.dtype or its name, not {dtype!r}")
        return value
    stored = _keys.checkpoint_float_dtype(keys)
    return getattr(torch, stored) if stored else torch.float32


def _load_diffusers_model(cls: Any, folder: str, name: str, dtype: Any,
                          cache_dir: str | os.PathLike | None = None) -> Unsettled:
    """A diffusers ``ModelMixin`` from its sub-folder, loaded by diffusers' own
    ``from_pretrained`` (its key conversions, ``_keep_in_fp32_modules``) in the
    resolved dtype; what it casts is written once into the conversion folder
    and mapped (:mod:`._drive`, :mod:`._drive_diffusers`). The ``keep_mapping``
    decision is the pipeline's (:func:`._report.settle`)."""
    import time

    start = time.perf_counter()
    files = diffusers_files(folder)
    torch_dtype = _resolve(dtype, _keys.read_keys(files))
    config = cls.load_config(folder)
    key = fingerprint(files, model_class=cls, dtype=torch_dtype, config=config)
    root = os.fspath(cache_dir) if cache_dir is not None else default_root(folder, key)
    cache = ConversionCache.open(root, key, origin=folder)
    while True:
        with driving(cache, diffusers_hooks(), files=files) as session, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*deprecated")
            model, info = cls.from_pretrained(folder, torch_dtype=torch_dtype, low_cpu_mem_usage=True,
                                              output_loading_info=True)
        again = convert_again(cache, session, f"{name} ({cls.__name__})")
        if again is None:
            break
        del model, info  # what the stale conversion made: never used
        cache = again
    problems = []
    if info.get("missing_keys"):
        problems.append(_keys.describe_keys("missing", sorted(info["missing_keys"])) + " (initialised by diffusers)")
    if info.get("unexpected_keys"):
        problems.append(_keys.describe_keys("unexpected", sorted(info["unexpected_keys"])) + " (not loaded)")
    if problems:
        warnings.warn(f"{folder} into {name} ({cls.__name__}): " + "; ".join(problems), stacklevel=4)
    model.eval()
    return Unsettled(model, files, info, cache, time.perf_counter() - start, "diffusers", folder)


def _component_class(library: str, class_name: str, name: str) -> Any:
    module = require(library, f"{WHAT} (component {name!r})")
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"model_index.json: component {name!r} names {library}.{class_name}, which does not exist")
    return cls


def _pipeline_class(pipeline_cls: Any, index: dict, folder: str) -> Any:
    diffusers = require("diffusers", WHAT)
    if pipeline_cls is not diffusers.DiffusionPipeline:
        return pipeline_cls
    cls = getattr(diffusers, str(index.get("_class_name")), None)
    if cls is None:
        raise ValueError(f"{folder}/model_index.json: _class_name {index.get('_class_name')!r} is not a diffusers class")
    return cls


def load_pipeline(
    pipeline_cls: Any,
    folder: str | os.PathLike,
    *,
    dtype: Any = "auto",
    keep_mapping: bool | None = True,
    cache_dir: str | os.PathLike | None = None,
    **components: Any,
) -> tuple[Any, dict[str, LoadReport]]:
    """Load a pipeline folder with every model component on the file mapping (no offload).

    See :func:`pipeline_from_pretrained`; returns the pipeline and one
    :class:`~mapoffload.LoadReport` per loaded model component.
    """
    return _load_pipeline(pipeline_cls, folder, dtype=dtype, keep_mapping=keep_mapping, cache_dir=cache_dir,
                          components=components, own=keyword_names(load_pipeline))


def _check_components(cls: Any, components: dict[str, Any], accepted: Any, own: tuple[str, ...]) -> None:
    """Each keyword beside the entry point's own names something the pipeline's ``__init__``
    takes (a component, or an argument such as ``requires_safety_checker``); else it is
    refused by name, before anything is loaded (diffusers would ignore it with a warning)."""
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return  # its __init__ takes any keyword
    takes = [n for n, p in accepted.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
    for name in components:
        if name in takes:
            continue
        if name in _DIFFUSERS_HABITS:
            raise TypeError(f"{WHAT} does not take {name}=: {_DIFFUSERS_HABITS[name]}")
        raise unexpected_keyword(WHAT, name, (*own, *takes),
                                 f"not a keyword of {WHAT}, nor a component or argument of {cls.__name__}")


def _load_pipeline(pipeline_cls: Any, folder: str | os.PathLike, *, dtype: Any, keep_mapping: bool | None,
                   cache_dir: str | os.PathLike | None, components: dict[str, Any],
                   own: tuple[str, ...]) -> tuple[Any, dict[str, LoadReport]]:
    """:func:`load_pipeline`, with ``own`` the entry point's keywords (for a "did you mean")."""
    import torch

    require("diffusers", WHAT)
    check_pipeline_class(pipeline_cls, WHAT)
    check_flags(keep_mapping=keep_mapping)
    cache_dir = check_cache_dir(cache_dir)
    folder = check_folder(folder, WHAT, beside="model_index.json beside the component folders")
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        other = (": it is a transformers model folder (config.json): load it with mapoffload.from_pretrained"
                 if os.path.isfile(os.path.join(folder, "config.json")) else "")
        raise FileNotFoundError(f"{index_path} not found: {WHAT} loads a pipeline folder written by "
                                f"save_pretrained{other}")
    with open(index_path) as f:
        index = json.load(f)
    cls = _pipeline_class(pipeline_cls, index, folder)
    accepted = inspect.signature(cls.__init__).parameters
    _check_components(cls, components, accepted, own)
    kwargs: dict[str, Any] = {}
    loaded: dict[str, Unsettled] = {}
    for name, entry in index.items():
        if name.startswith("_") or name not in accepted:
            continue
        if name in components:  # given by the caller (tokenizer=None, a model already built)
            kwargs[name] = components[name]
            continue
        if not isinstance(entry, list):  # a config value (requires_safety_checker)
            kwargs[name] = entry
            continue
        library, class_name = entry
        if library is None or class_name is None:
            kwargs[name] = None
            continue
        sub = os.path.join(folder, name)
        comp_cls = _component_class(library, class_name, name)
        if not (isinstance(comp_cls, type) and issubclass(comp_cls, torch.nn.Module)):
            kwargs[name] = comp_cls.from_pretrained(sub)  # scheduler, tokenizer, feature extractor
            continue
        component_dtype = dtype.get(name, "auto") if isinstance(dtype, dict) else dtype
        if library == "transformers":
            from .transformers import load_unsettled

            loaded[name] = load_unsettled(comp_cls, sub, dtype=component_dtype, strict=False, config=None,
                                          cache_dir=cache_dir, fp8="keep", model_kwargs={}, own=own, what=WHAT)
        else:
            loaded[name] = _load_diffusers_model(comp_cls, sub, name, component_dtype, cache_dir)
        kwargs[name] = loaded[name].model
    # One keep_mapping decision for the pipeline: its components' copies would all be in memory at once.
    settled = settle(list(loaded.values()), keep_mapping, component=f"{cls.__name__} ({', '.join(loaded)})")
    reports = dict(zip(loaded, settled))
    for name, value in components.items():
        if name not in kwargs:
            kwargs[name] = value
    pipe = cls(**kwargs)
    pipe.register_to_config(_name_or_path=folder)
    return pipe, reports


@shows_option_keywords
def pipeline_from_pretrained(
    pipeline_cls: Any,
    folder: str | os.PathLike,
    *,
    options: OffloadOptions | None = None,
    dtype: Any = "auto",
    keep_mapping: bool | None = True,
    cache_dir: str | os.PathLike | None = None,
    **components: Any,
) -> Any:
    """A diffusers pipeline from a local folder, on the file mapping, offloaded onto ``device``.

    Parameters
    ----------
    pipeline_cls
        A pipeline class (``FluxPipeline``) or ``DiffusionPipeline`` (the
        class named in ``model_index.json``).
    folder
        A local folder written by ``save_pretrained`` (``model_index.json`` and
        one sub-folder per component).
    options
        How every component is offloaded (:class:`~mapoffload.OffloadOptions`,
        as :func:`offload_pipeline` takes it); its fields may be given as
        keywords instead (``device="cuda"``). ``device=None`` without
        ``options``: no offload (the loaded pipeline on the host).
    dtype
        ``"auto"``: each component in the dtype its checkpoint stores (nothing
        converted); a dtype, or a dict ``{component: dtype}``, converts, once,
        into the conversion folder (``report.conversion_dir``).
    keep_mapping
        True (default): every weight on a file mapping (never more anonymous
        memory than diffusers' own load); False: copies into host memory;
        None asks the gate once for the pipeline, with the bytes all its
        components hold on the mapping (their copies would all be in memory),
        as :func:`~mapoffload.load_checkpoint` does (copies when they fit); each
        component's report records it.
    cache_dir
        Where converted tensors go (see :func:`mapoffload.from_pretrained`).
    **components
        The fields of :class:`~mapoffload.OffloadOptions`; then components to use instead of loading them (``tokenizer=None``, a
        model already built), and other arguments of the pipeline's
        ``__init__``, as with diffusers' ``from_pretrained``. Anything else is
        refused by name before anything is loaded, a misspelt keyword with the
        one meant (``prefech_layers=``: did you mean ``prefetch_layers=``?).

    Returns
    -------
    DiffusionPipeline
        ``pipe.mapoffload_reports`` maps each loaded model component to its
        :class:`~mapoffload.LoadReport`; ``pipe.mapoffload_handle`` is the
        :class:`~mapoffload.hf.offload.OffloadHandle` (``summary()``, ``close()``) or None.
    """
    offload = load_options(WHAT, options, components)  # checked before the load, not after it
    pipe, reports = _load_pipeline(pipeline_cls, folder, dtype=dtype, keep_mapping=keep_mapping, cache_dir=cache_dir,
                                   components=components, own=(*keyword_names(pipeline_from_pretrained), *FIELDS))
    handle = None
    if offload is not None:
        handle = offload_pipeline_with(pipe, offload, CallNames(
            "pipe.mapoffload_handle.close()",
            "mapoffload.pipeline_from_pretrained(cls, folder, device=..., dtype={dtype}): converted once into a "
            "mapped conversion folder"))
    object.__setattr__(pipe, "mapoffload_reports", reports)
    object.__setattr__(pipe, "mapoffload_handle", handle)
    return pipe
