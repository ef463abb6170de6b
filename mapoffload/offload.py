"""LayerwiseOffloadManager: stream a model's layers to the device one at a time.

Each layer's weights are held on the host in the store the budget allows
(``mapped`` / ``consolidated`` pinned or pageable / ``strided``, see
``_stores.py``), copied into per-layer device buffers through the native
copier on a copy stream, and released after the layer ran. With
``device="cpu"`` the "device buffers" are separate CPU buffers: the whole
machinery runs without a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._log import format_bytes, logger
from ._stores import CONSOLIDATED, MAPPED, STRIDED, LayerStore, Weight, build_consolidated, build_strided
from ._stores import extent_elements, layout, log_plan
from .budget import HOST_COPY_RESERVE_BYTES, host_copies_would_not_fit, host_memory_available_bytes
from .copier import Copier, CopyHandle
from .regions import MappedRegions

if TYPE_CHECKING:
    import torch

__all__ = ["LayerwiseOffloadManager"]

HOST_STORES = ("auto", "mapped", "pinned", "pageable")


def _resolve_layers(model: torch.nn.Module, layers: Any) -> list[torch.nn.Module]:
    import torch

    if isinstance(layers, str):
        obj: Any = model
        walked = []
        for part in layers.split("."):
            if not hasattr(obj, part):
                where = ".".join(walked) or type(model).__name__
                raise AttributeError(f"layer path {layers!r}: {where} has no attribute {part!r}")
            obj = getattr(obj, part)
            walked.append(part)
        layers = obj
    if not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)):
        raise TypeError(f"layers must be an nn.ModuleList or its attribute path, not {type(layers).__name__}")
    out = list(layers)
    if not all(isinstance(m, torch.nn.Module) for m in out):
        raise TypeError("every layer must be an nn.Module")
    return out


class _Loaded:
    """Device side of one layer: buffers per dtype, the copy in flight."""

    def __init__(self, buffers: dict, handle: CopyHandle | None, event: Any = None) -> None:
        self.buffers = buffers
        self.handle = handle
        self.ready = handle is None
        self.event = event


class LayerwiseOffloadManager:
    """Keep a model's layers on the host and stream each to the device when it runs.

    Parameters
    ----------
    model
        The model; parameters outside ``layers`` and all buffers are left alone.
    layers
        An ``nn.ModuleList`` or its attribute path (``"blocks"``, ``"encoder.layer"``).
    device
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
    prefetch_layers
        How many following layers each pre-hook starts copying.
    resident_layers
        The first N layers stay on the device once loaded.
    host_store
        ``"auto"`` (mapped when copies would not fit, pinned while the budget
        covers it, pageable for the rest), or force ``"mapped"``, ``"pinned"``,
        ``"pageable"`` where possible.
    copier
        A :class:`~mapoffload.Copier` for the device; one is made otherwise.
    copy_on_compute_stream
        Enqueue copies on the compute stream instead of a side stream (the
        seed runtime's path; for comparison).
    available_bytes
        Host budget to plan against (default: :func:`host_memory_available_bytes`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layers: Any,
        *,
        device: str | torch.device,
        prefetch_layers: int = 1,
        resident_layers: int = 0,
        host_store: str = "auto",
        copier: Copier | None = None,
        copy_on_compute_stream: bool = False,
        available_bytes: int | None = None,
    ) -> None:
        import torch

        if host_store not in HOST_STORES:
            raise ValueError(f"host_store must be one of {HOST_STORES}, not {host_store!r}")
        if prefetch_layers < 0 or resident_layers < 0:
            raise ValueError("prefetch_layers and resident_layers must be >= 0")
        self.model = model
        self.layers = _resolve_layers(model, layers)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch_layers = prefetch_layers
        self.resident_layers = resident_layers
        self.host_store = host_store
        self._owns_copier = copier is None
        self.copier = copier or Copier(self.device)
        if self.copier.device != self.device:
            raise ValueError(f"copier is on {self.copier.device}, the manager on {self.device}")
        self._cuda = self.device.type == "cuda"
        self._copy_stream = None
        if self._cuda and not copy_on_compute_stream:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._stores = self._collect()
        self._by_name = {n: (s, w) for s in self._stores for w in s.weights for n in w.names}
        self._plan(available_bytes)
        self._loaded: dict[int, _Loaded] = {}
        self._pool: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._placeholders: dict = {}
        self._device_bytes = 0
        self.peak_device_bytes = 0
        self._hooks: list = []
        self._layer_index = {id(m): i for i, m in enumerate(self.layers)}
        for i in range(len(self.layers)):
            self._bind_placeholders(i)

    # -- construction ----------------------------------------------------------------
    def _collect(self) -> list[LayerStore]:
        prefix = {id(m): n for n, m in self.model.named_modules()}
        owner: dict[int, int] = {}
        stores = []
        for i, layer in enumerate(self.layers):
            store = LayerStore(i)
            by_id: dict[int, Weight] = {}
            base = prefix.get(id(layer), f"layers.{i}")
            for name, p in layer.named_parameters(remove_duplicate=False):
                full = f"{base}.{name}" if base else name
                if id(p) in by_id:
                    by_id[id(p)].names.append(full)
                    continue
                if id(p) in owner and owner[id(p)] != i:
                    raise ValueError(f"parameter {full} is shared by layers {owner[id(p)]} and {i}: not supported")
                if p.device.type == "meta":
                    raise ValueError(f"parameter {full} is on the meta device: load the checkpoint first")
                owner[id(p)] = i
                data = p.data
                nbytes = (extent_elements(data) if not data.is_contiguous() else data.numel()) * data.element_size()
                w = Weight([full], p, data.dtype, tuple(data.shape), tuple(data.stride()), nbytes=nbytes)
                by_id[id(p)] = w
                store.weights.append(w)
            stores.append(store)
        return stores

    def _plan(self, available_bytes: int | None) -> None:
        weights = [w for s in self._stores for w in s.weights]
        on_mapping = MappedRegions().classify([w.param.data for w in weights])
        mapped_candidates = {id(w) for w, m in zip(weights, on_mapping) if m and w.contiguous}
        candidate_bytes = sum(w.nbytes for w in weights if id(w) in mapped_candidates)
        if available_bytes is None:
            available_bytes = host_memory_available_bytes()
        if self.host_store == "mapped":
            keep_mapped = True
        elif self.host_store == "auto":
            keep_mapped = host_copies_would_not_fit(candidate_bytes, available_bytes=available_bytes)
        else:
            keep_mapped = False
        for w in weights:
            if keep_mapped and id(w) in mapped_candidates:
                w.store = MAPPED
                w.host = w.param.data
            elif not w.contiguous:
                w.store = STRIDED
        budget = available_bytes - HOST_COPY_RESERVE_BYTES
        pin_allowed = self._cuda and self.host_store in ("auto", "pinned")
        if self.host_store == "pinned" and not self._cuda:
            logger.info("host_store='pinned' on %s: pinning needs CUDA, using pageable buffers", self.device)
        for store in self._stores:
            layout(store)
            consolidated = store.bytes_in(CONSOLIDATED)
            pin = pin_allowed and (self.host_store == "pinned" or consolidated <= budget)
            if pin:
                budget -= consolidated
            build_consolidated(store, pin)
            for w in store.weights:
                if w.store == STRIDED:
                    build_strided(w)
        log_plan(self._stores, self.device)

    # -- accounting ----------------------------------------------------------------------
    def _sum(self, pred) -> int:
        return sum(w.nbytes for s in self._stores for w in s.weights if pred(s, w))

    @property
    def mapped_bytes(self) -> int:
        """Bytes of weights kept on their file mapping."""
        return self._sum(lambda s, w: w.store == MAPPED)

    @property
    def pinned_bytes(self) -> int:
        return self._sum(lambda s, w: w.store == CONSOLIDATED and s.pinned)

    @property
    def pageable_bytes(self) -> int:
        """Consolidated pageable plus strided host bytes."""
        return self._sum(lambda s, w: (w.store == CONSOLIDATED and not s.pinned) or w.store == STRIDED)

    @property
    def device_bytes(self) -> int:
        """Bytes of device buffers held now (in use or pooled for reuse)."""
        return self._device_bytes

    def layer_bytes(self, i: int) -> int:
        """Bytes one prefetch of layer ``i`` moves."""
        return sum(w.nbytes for w in self._stores[self._check_index(i)].weights)

    def store_of(self, name: str) -> str:
        """The host store of a managed weight: ``mapped``, ``consolidated`` or ``strided``."""
        return self._weight(name)[1].store

    # -- device buffers --------------------------------------------------------------------
    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        import torch

        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.zeros(1, dtype=dtype, device=self.device)
        return self._placeholders[dtype]

    def _bind_placeholders(self, i: int) -> None:
        for w in self._stores[i].weights:
            w.param.data = self._placeholder(w.dtype)

    def _take_buffer(self, nbytes: int):
        import torch

        pool = self._pool.get(nbytes)
        if pool:
            return pool.pop()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._copy_stream is not None:
            # Written on the copy stream: the caching allocator must not hand
            # this memory to another stream before that work is done.
            buf.record_stream(self._copy_stream)
        self._device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self._device_bytes)
        return buf, None

    def _give_buffer(self, buf: torch.Tensor) -> None:
        import torch

        event = None
        if self._cuda:
            # The compute stream may still read it: a later copy waits for this.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._pool.setdefault(buf.numel(), []).append((buf, event))

    # -- loading ---------------------------------------------------------------------------
    def _check_index(self, i: int) -> int:
        if not -len(self.layers) <= i < len(self.layers):
            raise IndexError(f"layer {i} out of range (model has {len(self.layers)} managed layers)")
        return i % len(self.layers)

    def prefetch_layer(self, i: int, non_blocking: bool = True) -> None:
        """Start copying layer ``i`` to the device (no-op when loaded or in flight).

        With ``non_blocking=False`` it also waits until the layer is usable.
        """
        import torch

        i = self._check_index(i)
        if i not in self._loaded:
            store = self._stores[i]
            stream = self._copy_stream or (torch.cuda.current_stream(self.device) if self._cuda else None)
            bases = {}
            buffers = {}
            for dtype, nbytes in store.dtype_bytes.items():
                buf, event = self._take_buffer(nbytes)
                if event is not None:
                    stream.wait_event(event)
                buffers[dtype] = buf
                bases[dtype] = buf.data_ptr()
            sources = store.sources()
            dst = [bases[dtype] + offset for dtype, offset, _, _ in sources]
            src = [host.data_ptr() for _, _, host, _ in sources]
            sizes = [n for _, _, _, n in sources]
            handle = self.copier.copy_spans(dst, src, sizes, stream=stream, keepalive=(sources, buffers))
            self._loaded[i] = _Loaded(buffers, handle)
        if not non_blocking:
            self._ensure(i)

    def _ensure(self, i: int) -> None:
        import torch

        if i not in self._loaded:
            self.prefetch_layer(i)
        loaded = self._loaded[i]
        if loaded.ready:
            return
        loaded.handle.wait()
        if self._cuda and self._copy_stream is not None:
            event = torch.cuda.Event()
            event.record(self._copy_stream)
            torch.cuda.current_stream(self.device).wait_event(event)
        for w in self._stores[i].weights:
            buf = loaded.buffers[w.dtype]
            if w.store == STRIDED:
                elems = w.nbytes // w.param.element_size()
                flat = buf[w.offset : w.offset + w.nbytes].view(w.dtype)[:elems]
                w.param.data = flat.as_strided(w.shape, w.stride)
            else:
                w.param.data = buf[w.offset : w.offset + w.nbytes].view(w.dtype).view(w.shape)
        loaded.ready = True
        loaded.handle = None

    def release_layer(self, i: int) -> None:
        """Drop layer ``i``'s device copy (its parameters become placeholders)."""
        i = self._check_index(i)
        loaded = self._loaded.pop(i, None)
        if loaded is None:
            return
        if loaded.handle is not None:
            loaded.handle.wait()  # never recycle a buffer a copy may still write
        self._bind_placeholders(i)
        for buf in loaded.buffers.values():
            self._give_buffer(buf)

    def release_all(self) -> None:
        for i in list(self._loaded):
            self.release_layer(i)

    def load_all_layers(self) -> None:
        """Load every layer onto the device (and keep it there until released)."""
        for i in range(len(self.layers)):
            self.prefetch_layer(i)
        for i in range(len(self.layers)):
            self._ensure(i)

    def is_loaded(self, i: int) -> bool:
        i = self._check_index(i)
        return i in self._loaded and self._loaded[i].ready

    # -- hooks ------------------------------------------------------------------------------
    def register_forward_hooks(self) -> None:
        """Load each layer before it runs, prefetch the next ones, release it after."""
        if self._hooks:
            return
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(self._make_pre_hook(i)))
            self._hooks.append(layer.register_forward_hook(self._make_post_hook(i)))

    def remove_forward_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _make_pre_hook(self, i: int):
        def pre_hook(module, args):
            import torch

            if torch.is_grad_enabled() and any(w.param.requires_grad for w in self._stores[i].weights):
                raise RuntimeError(
                    "LayerwiseOffloadManager is for inference: run the model under torch.no_grad() or "
                    "torch.inference_mode() (gradients through offloaded weights are not supported)"
                )
            self._ensure(i)
            keep = set(range(i, min(len(self.layers), i + 1 + self.prefetch_layers)))
            for j in list(self._loaded):  # stale prefetches (skipped or reordered layers)
                if j not in keep and j >= self.resident_layers:
                    self.release_layer(j)
            for j in sorted(keep - {i}):
                self.prefetch_layer(j)

        return pre_hook

    def _make_post_hook(self, i: int):
        def post_hook(module, args, output):
            if i >= self.resident_layers:
                self.release_layer(i)

        return post_hook

    # -- host weights ------------------------------------------------------------------------
    def _weight(self, name: str) -> tuple[LayerStore, Weight]:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{name} is not a weight managed by this LayerwiseOffloadManager") from None

    def iter_cpu_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, host tensor)`` for every managed weight, mapped ones included."""
        for s in self._stores:
            for w in s.weights:
                for n in w.names:
                    yield n, w.host

    def cpu_weights_checksum(self) -> str:
        """SHA-256 over names and host bytes: the same whether a weight is mapped or copied."""
        import torch

        h = hashlib.sha256()
        for name, t in sorted(self.iter_cpu_weights(), key=lambda kv: kv[0]):
            h.update(name.encode())
            h.update(str(t.dtype).encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def sync_layer_to_cpu(self, i: int) -> None:
        """Write layer ``i``'s device weights back to its host stores.

        Mapped weights are never written (a write would turn their pages
        anonymous); consolidated and strided stores are updated.
        """
        i = self._check_index(i)
        if i not in self._loaded:
            return  # nothing on the device to write back
        self._ensure(i)
        for w in self._stores[i].weights:
            if w.store == MAPPED:
                continue
            w.host.copy_(w.param.data)

    def update_cpu_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterator) -> None:
        """Replace host weights; a mapped entry becomes an owned tensor.

        The checkpoint file is never written. A loaded layer's device copy is
        updated as well.
        """
        import torch

        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        for name, value in items:
            store, w = self._weight(name)
            if tuple(value.shape) != w.shape:
                raise ValueError(f"{name}: new shape {tuple(value.shape)} does not match {w.shape}")
            value = value.detach().to(device="cpu", dtype=w.dtype)
            if w.store == MAPPED:
                # An owned tensor of its own (the strided store's kind): the
                # mapping is left as it is.
                w.host = value.clone(memory_format=torch.contiguous_format)
                w.store = STRIDED
                store.invalidate_sources()
            else:
                w.host.copy_(value)
            if self.is_loaded(store.index):
                w.param.data.copy_(value.to(self.device))

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove hooks, release device buffers, stop an owned copier."""
        import torch

        self.remove_forward_hooks()
        self.release_all()
        if self._cuda:
            torch.cuda.synchronize(self.device)  # copies into pooled buffers may still run
        self._pool.clear()
        self._device_bytes = 0
        if self._owns_copier:
            self.copier.close()

    def __repr__(self) -> str:
        return (
            f"LayerwiseOffloadManager({len(self.layers)} layers on {self.device}: "
            f"{format_bytes(self.mapped_bytes)} mapped, {format_bytes(self.pinned_bytes)} pinned, "
            f"{format_bytes(self.pageable_bytes)} pageable)"
        )
