"""diffusers pipelines on the file mapping: ``mapoffload.pipeline_from_pretrained``
and ``mapoffload.offload_pipeline``.

Names, as a diffusers user looks for them: diffusers loads a pipeline with
``DiffusionPipeline.from_pretrained(folder)`` and offloads one with
``pipe.enable_model_cpu_offload()``; here ``pipeline_from_pretrained(cls, folder,
device=...)`` is the first (the class first, as in
:func:`mapoffload.from_pretrained`) and ``offload_pipeline(pipe, device=...)``
the second, for a pipeline the user already has.

Each model component of ``model_index.json`` is built on meta in the dtype
its checkpoint stores and loaded on the file mapping when the gate says host
copies would not fit (:func:`~mapoffload.keep_checkpoint_mapped`, asked once
per component under the component's name; the gate measures available memory
each time, so the copies of earlier components count against later ones).
transformers components (text encoders) go through
:func:`~mapoffload.hf.transformers.load_pretrained` and its key conventions.
Offloading streams each component's block lists (:func:`find_block_lists`:
Flux's ``transformer_blocks`` + ``single_transformer_blocks``, SD3's
``transformer_blocks``, a text encoder's layers; a UNet's ``down_blocks`` and
``up_blocks``) and places the rest, one :class:`OffloadHandle` per component.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._files import checkpoint_bytes, checkpoint_files
from .._log import logger
from ..checkpoint import LoadReport, empty_weights, keep_checkpoint_mapped, load_checkpoint
from . import _keys
from ._extras import require
from ._summary import OffloadRow
from .blocks import find_block_lists
from .offload import OffloadHandle, offload

if TYPE_CHECKING:
    import torch

__all__ = ["PipelineOffloadHandle", "load_pipeline", "offload_pipeline", "pipeline_from_pretrained"]

WHAT = "mapoffload.pipeline_from_pretrained"


class PipelineOffloadHandle:
    """What :func:`offload_pipeline` set up: one :class:`OffloadHandle` per model component.

    ``summary()`` describes it (one row per component's stack/unit),
    ``close()`` gives every component back whole (idempotent); it is a
    context manager.
    """

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.components: dict[str, OffloadHandle] = {}

    @property
    def rows(self) -> list[OffloadRow]:
        """Every component's :class:`OffloadRow` (``component`` set), measured now."""
        out = []
        for name, h in self.components.items():
            for row in h.rows:
                row.component = name
                out.append(row)
        return out

    def summary(self) -> str:
        """One table for the pipeline, grouped by component (≤ 100 columns): where each unit's bytes
        live, how it computes, what a forward re-reads; totals against a full host copy; why, per unit.
        See :meth:`OffloadHandle.summary`."""
        from ._summary import format_rows

        devices = {h.device for h in self.components.values()}
        return format_rows(self.rows, next(iter(devices)) if len(devices) == 1 else None)

    def close(self) -> None:
        """Give every component back whole, with its real weights."""
        for h in self.components.values():
            h.close()

    def __enter__(self) -> PipelineOffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PipelineOffloadHandle({type(self.pipe).__name__}:\n{self.summary()})"


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


def offload_pipeline(
    pipe: Any,
    *,
    device: str | torch.device,
    prefetch_layers: int = 1,
    host_store: str | None = None,
    rest: str = "auto",
    skip: tuple[str, ...] = (),
) -> PipelineOffloadHandle:
    """Offload every model component of a diffusers pipeline onto ``device``.

    Each ``torch.nn.Module`` component (text encoders, denoiser, VAE) goes
    through :func:`mapoffload.offload`: its block lists streamed layer by
    layer, the rest placed on the device when it fits (streamed module by
    module when not). A component without a block list is placed whole, or
    streamed module by module when it does not fit.

    Parameters
    ----------
    pipe
        A ``DiffusionPipeline`` (any object with a ``components`` dict).
    device
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
    prefetch_layers, host_store, rest
        Passed to :func:`mapoffload.offload` for each component.
    skip
        Component names left alone.

    Returns
    -------
    PipelineOffloadHandle
    """
    import torch

    handle = PipelineOffloadHandle(pipe)
    try:
        for name, component in pipe.components.items():
            if not isinstance(component, torch.nn.Module) or name in skip:
                continue
            layers = _stacks(component)
            handle.components[name] = offload(component, device=device, layers=layers, rest=rest,
                                              prefetch_layers=prefetch_layers, host_store=host_store)
    except BaseException:
        handle.close()
        raise
    logger.info("offload of %s:\n%s", type(pipe).__name__, handle.summary())
    return handle


# --- loading ------------------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build in ``dtype`` as diffusers does (``_set_default_torch_dtype``):
    floating tensors the constructor makes come out in it."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _keep_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``_keep_in_fp32_modules`` parameters rebuilt on meta in float32, as diffusers loads them."""
    import torch

    keep = getattr(type(model), "_keep_in_fp32_modules", None)
    if not keep or dtype == torch.float32:
        return
    keep = [keep] if isinstance(keep, str) else list(keep)
    for mod_name, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            full = f"{mod_name}.{attr}" if mod_name else attr
            if p is not None and p.is_floating_point() and any(k in full.split(".") for k in keep):
                module._parameters[attr] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=torch.float32, device="meta"), requires_grad=p.requires_grad)


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
                          keep_mapping: bool | None) -> tuple[torch.nn.Module, LoadReport]:
    """A diffusers ``ModelMixin`` from its sub-folder, built on meta, loaded mapped."""
    keys = _keys.read_keys(checkpoint_files(folder))
    torch_dtype = _resolve(dtype, keys)
    config = cls.load_config(folder)
    with empty_weights(), _default_dtype(torch_dtype):
        model = cls.from_config(config)
    _keep_fp32(model, torch_dtype)
    report = load_checkpoint(model, folder, keep_mapping=keep_mapping, strict=False)
    problems = []
    if report.missing_keys:
        problems.append(_keys.describe_keys("missing", report.missing_keys) + " (buffers: kept as built)")
    if report.unexpected_keys:
        problems.append(_keys.describe_keys("unexpected", report.unexpected_keys) + " (not loaded)")
    if problems:
        warnings.warn(f"{folder} into {name} ({cls.__name__}): " + "; ".join(problems), stacklevel=4)
    converted = report.copied.get("dtype", 0)
    if converted:
        warnings.warn(_keys.describe_conversion(converted, [], False, folder), stacklevel=4)
    model.register_to_config(_name_or_path=folder)
    model.eval()
    return model, report


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
    keep_mapping: bool | None = None,
    **components: Any,
) -> tuple[Any, dict[str, LoadReport]]:
    """Load a pipeline folder with every model component on the file mapping (no offload).

    See :func:`pipeline_from_pretrained`; returns the pipeline and one
    :class:`~mapoffload.LoadReport` per loaded model component.
    """
    import torch

    require("diffusers", WHAT)
    folder = os.fspath(folder)
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise FileNotFoundError(
            f"{index_path} not found: {WHAT} loads a local pipeline folder written by save_pretrained "
            "(download first, e.g. huggingface_hub.snapshot_download, and pass its path)"
        )
    with open(index_path) as f:
        index = json.load(f)
    cls = _pipeline_class(pipeline_cls, index, folder)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {}
    reports: dict[str, LoadReport] = {}
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
        keep = keep_mapping
        if keep is None:  # the gate, under the component's name
            keep = keep_checkpoint_mapped(weight_bytes=checkpoint_bytes(sub),
                                          component=f"{name} ({class_name})")
        if library == "transformers":
            from .transformers import load_pretrained

            model, report = load_pretrained(comp_cls, sub, dtype=component_dtype, keep_mapping=keep)
        else:
            model, report = _load_diffusers_model(comp_cls, sub, name, component_dtype, keep)
        kwargs[name] = model
        reports[name] = report
    for name, value in components.items():
        if name not in kwargs:
            kwargs[name] = value
    pipe = cls(**kwargs)
    pipe.register_to_config(_name_or_path=folder)
    return pipe, reports


def pipeline_from_pretrained(
    pipeline_cls: Any,
    folder: str | os.PathLike,
    *,
    device: str | torch.device | None,
    dtype: Any = "auto",
    keep_mapping: bool | None = None,
    prefetch_layers: int = 1,
    host_store: str | None = None,
    rest: str = "auto",
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
    device
        Where the pipeline runs; None: no offload (the loaded pipeline on the host).
    dtype
        ``"auto"``: each component in the dtype its checkpoint stores (nothing
        converted); a dtype, or a dict ``{component: dtype}``, converts (a
        warning says how many bytes).
    keep_mapping
        None: the gate decides per component; True/False for all.
    prefetch_layers, host_store, rest
        Passed to :func:`offload_pipeline`.
    **components
        Components to use instead of loading them (``tokenizer=None``, a
        model already built), as with diffusers' ``from_pretrained``.

    Returns
    -------
    DiffusionPipeline
        ``pipe.mapoffload_reports`` maps each loaded model component to its
        :class:`~mapoffload.LoadReport`; ``pipe.mapoffload_handle`` is the
        :class:`PipelineOffloadHandle` (``summary()``, ``close()``) or None.
    """
    pipe, reports = load_pipeline(pipeline_cls, folder, dtype=dtype, keep_mapping=keep_mapping, **components)
    handle = None
    if device is not None:
        handle = offload_pipeline(pipe, device=device, prefetch_layers=prefetch_layers, host_store=host_store,
                                  rest=rest)
    object.__setattr__(pipe, "mapoffload_reports", reports)
    object.__setattr__(pipe, "mapoffload_handle", handle)
    return pipe
