"""Weights vLLM rebuilds after loading, mapped too.

``process_weights_after_loading`` lets each layer's method turn its weights
into what its kernel wants: the CPU MoE kernel prepacks every expert stack
into its own blocked layout, a small GEMM casts a bias. Those new tensors are
vLLM's own anonymous memory. :class:`PostProcessed` watches each method's call
(one layer at a time): on the first start it writes every parameter the call
replaced into the conversion folder (a batch of at most ``PART_BYTES`` at a
time) and rebinds it to its mapped view; on later starts the method still runs
(it sets up more than weights) and each parameter it makes is swapped at once
for the identical bytes already in the folder. So at most one layer's rebuilt
weights (or one batch) are ever anonymous.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .._log import logger
from ..conversion import PART_BYTES, ConversionCache
from ..memory.regions import tensor_bytes

PREFIX = "post:"  # names of rebuilt weights in the conversion folder


class PostProcessed:
    """Maps the parameters ``process_weights_after_loading`` replaces (see the module)."""

    def __init__(self, cache: ConversionCache) -> None:
        self.cache = cache
        self.writing = not cache.reused
        self._stored = cache.mapped() if cache.reused else {}
        self._pending: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        self._pending_bytes = 0
        self.mapped = 0  # bytes rebound to the folder
        self.anonymous: list[str] = []  # replaced parameters left in memory (the folder lacks them)
        self._names: dict[int, str] = {}  # module id -> its name's prefix, while watching

    def stored(self, layer: torch.nn.Module, attr: str) -> torch.Tensor | None:
        """What a reused conversion holds for ``layer.attr`` after post-processing (None: nothing, or
        this start writes the folder): lets a rebuild skip work whose result is already mapped."""
        prefix = self._names.get(id(layer))
        return None if prefix is None else self._stored.get(f"{PREFIX}{prefix}{attr}")

    def _flush(self) -> None:
        if not self._pending:
            return
        views = self.cache.add({k: t for k, (_, _, t) in self._pending.items()}, {})
        for key, (layer, attr, _) in self._pending.items():
            getattr(layer, attr).data = views[key]
        self._pending.clear()
        self._pending_bytes = 0

    def _after(self, prefix: str, layer: torch.nn.Module, before: dict[str, int]) -> None:
        for attr, p in list(layer.named_parameters(recurse=False)):
            if not p.numel() or before.get(attr) == p.data_ptr():
                continue
            key = f"{PREFIX}{prefix}{attr}"
            self.mapped += tensor_bytes(p)
            if self.writing:
                self._pending[key] = (layer, attr, p.data.contiguous())
                self._pending_bytes += tensor_bytes(p)
                if self._pending_bytes >= PART_BYTES:
                    self._flush()
                continue
            stored = self._stored.get(key)
            if stored is None or stored.shape != p.shape or stored.dtype != p.dtype:
                self.mapped -= tensor_bytes(p)
                self.anonymous.append(f"{prefix}{attr}")
                continue
            p.data = stored

    @contextmanager
    def watching(self, model: torch.nn.Module) -> Iterator[None]:
        """While active, every layer method's ``process_weights_after_loading`` is followed by
        :meth:`_after` for its layer; the last batch is written when it ends."""
        patched: dict[int, tuple[object, object]] = {}
        names = self._names = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}

        def wrap(method: object) -> None:
            original = method.process_weights_after_loading

            def process(layer: torch.nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003
                before = {a: p.data_ptr() for a, p in layer.named_parameters(recurse=False)}
                out = original(layer, *args, **kwargs)
                self._after(names.get(id(layer), ""), layer, before)
                return out

            method.process_weights_after_loading = process
            patched[id(method)] = (method, original)

        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading") and id(method) not in patched:
                wrap(method)
        try:
            yield
            if self.writing:
                self._flush()
        finally:
            for method, original in patched.values():
                try:
                    del method.process_weights_after_loading  # the class's own again
                except AttributeError:
                    method.process_weights_after_loading = original
        if self.anonymous:
            logger.warning("%d weight(s) vLLM rebuilt after loading are not in the conversion folder %s and stay "
                           "in memory: %s", len(self.anonymous), self.cache.path, ", ".join(self.anonymous[:5]))
