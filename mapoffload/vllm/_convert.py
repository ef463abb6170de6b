"""Bind a vLLM model's parameters to the mapping: the checkpoint where vLLM keeps a
tensor unchanged, a mapped conversion folder for what vLLM builds.

The first start runs vLLM's own ``model.load_weights`` over mapped checkpoint
tensors, every parameter bound to a shared mapping of a conversion part (see
:mod:`._aliases`): what vLLM builds (stacked q/k/v, gate/up, padded
vocabularies, shards, expert stacks) is written straight into the file, and
what it would only copy becomes a view of the checkpoint. Once written, the
converted parameters are private (copy-on-write) views of the part, as on a
start that reuses it: a weight update stays in its process. The folder is keyed
by everything that decides those bytes; every later start maps it and skips
the load entirely.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._log import logger
from ..loading.read import read_files
from ..memory.regions import tensor_bytes
from ..conversion import ConversionCache
from ..conversion import default_root, fingerprint
from ._aliases import AliasRecorder, SourceIndex

FORMAT = 1  # the "vllm" entry of a conversion's meta


@dataclass
class Bound:
    """Where a model's parameter bytes came from."""

    mapped: int = 0  # bytes that are views of the checkpoint files
    converted: int = 0  # bytes in the conversion folder (mapped too)
    copied: int = 0  # bytes a weight loader put in memory of its own
    packed: int = 0  # bytes of weights vLLM's CPU backend replaced by its GEMM library's packed copies
    reused: bool = False  # the conversion folder was there already
    folder: str | None = None  # where the conversion lives (None: none kept)
    copied_names: list[str] = field(default_factory=list)
    sources: SourceIndex | None = field(default=None, repr=False)  # the checkpoint's tensors, by address

    def recount(self, model: torch.nn.Module) -> None:
        """Count where ``model``'s parameters are now (after vLLM's post-processing replaced some):
        views of the checkpoint, of another file (the conversion folder), or memory of their own."""
        from ..memory.regions import MappedRegions

        params = [p for p in model.parameters() if p.numel()]
        in_files = MappedRegions().classify(params)
        self.mapped = self.converted = self.copied = 0
        for p, in_file in zip(params, in_files):
            if self.sources is not None and self.sources.find(p.data) is not None:
                self.mapped += tensor_bytes(p)
            elif in_file:
                self.converted += tensor_bytes(p)
            else:
                self.copied += tensor_bytes(p)


@contextlib.contextmanager
def hidden(params: Iterable[torch.nn.Parameter], device: torch.device) -> Iterator[None]:
    """While active, ``params`` are views of one scratch buffer on ``device`` (as big as the largest
    of them): vLLM's weight loaders and post-processing run over them without reading or writing
    their real bytes (what lands in the scratch is thrown away). Their data is put back after,
    unless something replaced it meanwhile (then that stays, for the caller to find)."""
    params = [p for p in params if p.numel()]
    size = max((tensor_bytes(p) for p in params), default=0)
    scratch = torch.empty(size, dtype=torch.uint8, device=device)
    low, high = scratch.data_ptr(), scratch.data_ptr() + size
    saved = []
    for p in params:
        saved.append((p, p.data))
        p.data = scratch[:tensor_bytes(p)].view(p.dtype).view(p.shape)
    try:
        yield
    finally:
        for p, data in saved:
            if p.device == scratch.device and low <= p.data_ptr() < high:
                p.data = data


def conversion_key(files: list[str], *, architecture: str, dtype: Any, hf_config: Any, extra: dict) -> str:
    """The conversion folder's name: sources, class, dtype, config, versions and ``extra``
    (vLLM's version, parallel layout, quantization, the parameters' shapes)."""
    return fingerprint(files, model_class=f"vllm:{architecture}", dtype=dtype, config=hf_config,
                       extra={"vllm_format": FORMAT, **extra})


def _slice(source: torch.Tensor, byte_offset: int, like: torch.Tensor) -> torch.Tensor:
    flat = source.reshape(-1).view(torch.uint8)
    return flat[byte_offset: byte_offset + tensor_bytes(like)].view(like.dtype).view(like.shape)


def _rebind(params: dict[str, torch.nn.Parameter], cache: ConversionCache,
            tensors: dict[str, torch.Tensor]) -> Bound | None:
    """Bind every parameter from a finished conversion; None (nothing changed) when it does not cover them."""
    vllm_meta = cache.meta.get("vllm")
    aliases = vllm_meta.get("aliases") if isinstance(vllm_meta, dict) else None
    if not isinstance(aliases, dict):
        return None
    plan: dict[str, torch.Tensor] = {}
    converted = cache.mapped()
    for name, p in params.items():
        if name in aliases:
            entry = aliases[name]
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and type(entry[1]) is int):
                return None  # a manifest this module did not write: convert again
            key, offset = entry
            src = tensors.get(key)
            if src is None or offset < 0 or offset + tensor_bytes(p) > tensor_bytes(src) or offset % p.element_size():
                return None
            plan[name] = _slice(src, offset, p)
        elif name in converted and converted[name].shape == p.shape and converted[name].dtype == p.dtype:
            plan[name] = converted[name]
        else:
            return None
    bound = Bound(reused=True)
    for name, t in plan.items():
        params[name].data = t
        if name in aliases:
            bound.mapped += tensor_bytes(t)
        else:
            bound.converted += tensor_bytes(t)
    return bound


def _convert(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], cache: ConversionCache,
             tensors: dict[str, torch.Tensor], sources: SourceIndex, check_loaded: Any) -> Bound:
    specs = {name: (tuple(p.shape), p.dtype) for name, p in params.items()}
    views = cache.reserve(specs)
    for name, p in params.items():
        p.data = views[name]
    bound_to = {name: p.data for name, p in params.items()}
    recorder = AliasRecorder(dict(bound_to), sources)
    try:
        with recorder, torch.no_grad():
            loaded = model.load_weights(iter(tensors.items()))
        check_loaded(model, loaded)
    except BaseException:
        cache.abandon()
        raise
    bound = Bound(sources=sources)
    aliases: dict[str, list] = {}
    for name, p in params.items():
        alias = recorder.aliases.get(name)
        if alias is not None:
            p.data = alias.source.view(p.shape)
            aliases[name] = [alias.key, alias.byte_offset]
            bound.mapped += tensor_bytes(p)
            continue
        if p.data_ptr() == bound_to[name].data_ptr() and p.numel() == bound_to[name].numel():
            bound.converted += tensor_bytes(p)
            continue
        cache.forget([name])  # a loader put other bytes in its place: a view of the checkpoint, or its own copy
        found = sources.find(p.data)
        if found is not None:
            aliases[name] = [found[0], found[1]]
            bound.mapped += tensor_bytes(p)
        else:
            bound.copied += tensor_bytes(p)
            bound.copied_names.append(name)
    # Written: the converted parameters become private views of it, as on a start that reuses it.
    for name, t in cache.seal({name: p.data for name, p in params.items()}).items():
        params[name].data = t
    cache.forget(aliases)
    cache.meta = {"vllm": {"format": FORMAT, "aliases": aliases}}
    if bound.copied_names:
        logger.warning("vLLM's loaders replaced %d parameter(s) with memory of their own (%s): they are not "
                       "mapped, and no conversion is kept (a later start could not rebuild them from it)",
                       len(bound.copied_names), ", ".join(bound.copied_names[:5]))
        cache.abandon()
    return bound


def bind_mapped(model: torch.nn.Module, files: list[str], *, key: str, cache_dir: str | None,
                folder: str, check_loaded: Any, only: set[str] | None = None) -> tuple[Bound, ConversionCache]:
    """Bind ``model``'s parameters to the checkpoint ``files`` and the conversion ``key``.

    ``only``: bind just these parameters (the device path's offloaded layers); vLLM's loaders fill
    the others as they do, when they run (a reused conversion binds without running them).

    A finished, whole conversion is reused; otherwise one is written, and returned *unfinished*:
    the caller adds what post-processing rebuilds, then commits it (or abandons it on failure).
    """
    every = dict(model.named_parameters())
    params = every if only is None else {n: p for n, p in every.items() if n in only}
    tensors = read_files(files)
    sources = SourceIndex(tensors)  # one index of the checkpoint's addresses for the whole load
    root = cache_dir or default_root(folder, key)
    cache = ConversionCache.open(root, key, origin=folder)
    if cache.reused:
        bound = _rebind(params, cache, tensors)
        if bound is not None:
            bound.sources = sources
            return bound, cache
        logger.warning("conversion %s does not cover this model's parameters: converting again", cache.path)
        cache.discard()  # else the folder written next is dropped for it, and every start converts again
        cache = ConversionCache(root, key, origin=cache.origin)
    os.makedirs(root, exist_ok=True)
    return _convert(model, params, cache, tensors, sources, check_loaded), cache
