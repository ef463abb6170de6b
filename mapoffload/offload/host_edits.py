"""Host weights read and replaced: the manager's ``iter_cpu_weights``, ``cpu_weights_checksum``,
``sync_layer_to_cpu`` and ``update_cpu_weights``.

A mapped weight is never written (a write would turn its pages anonymous): a sync skips it, an
update replaces it with an owned tensor and never writes to the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from .._log import logger
from .stores import CONSOLIDATED, MAPPED, STRIDED, LayerStore, Weight

if TYPE_CHECKING:
    import torch

    from .layer_pages import LayerPages
    from .sequencer import Sequencer

__all__ = ["checksum", "iter_cpu_weights", "sync_layer_to_cpu", "update_cpu_weights"]


def iter_cpu_weights(stores: list[LayerStore]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, host tensor)`` for every weight of ``stores``, mapped ones included."""
    for s in stores:
        for w in s.weights:
            for n in w.names:
                yield n, w.host


def checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names and host bytes: the same whether a weight is mapped or copied."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sync_layer_to_cpu(seq: Sequencer, i: int) -> None:
    """Write layer ``i``'s device weights back to its host stores (``seq``: the stack's sequencer).

    Mapped weights are never written (a write would turn their pages
    anonymous); consolidated and strided stores are updated.
    """
    if i not in seq.loaded or not seq.loads.copies:
        return  # nothing on the device to write back (in place: the host store is what computes)
    seq.ensure(i)
    loaded = seq.loaded[i]
    for w in seq.stores[i].weights:
        seq.loads.write_back(w, loaded)


def update_cpu_weights(named_tensors: Mapping[str, torch.Tensor] | Iterator, *, seq: Sequencer,
                       pages: LayerPages, weight: Callable[[str], tuple[LayerStore, Weight]],
                       device: torch.device) -> None:
    """Replace host weights; a mapped entry becomes an owned tensor.

    ``seq`` is the stack's sequencer (its loads and slots), ``pages`` its pages, ``weight(name)`` the
    managed weight of a name (``KeyError`` otherwise), ``device`` where the layers compute.

    The checkpoint file is never written. A loaded layer's device copy is
    updated as well. A value of another dtype is converted when that loses
    no kind of information (``torch.can_cast``: float64 into float32 is
    fine, complex into real or float into int is not).

    Raises
    ------
    KeyError
        The name is not a managed weight.
    ValueError
        The shape differs, or the value is on the meta device (no data).
    TypeError
        The value is not a tensor, or its dtype cannot be cast to the weight's.
    """
    import torch

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    settled = False  # the device has finished every copy queued so far
    for name, value in items:
        store, w = weight(name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: the new value is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != w.shape:
            raise ValueError(f"{name}: new shape {tuple(value.shape)} does not match {w.shape}")
        if value.device.type == "meta":
            raise ValueError(f"{name}: the new value is on the meta device (it has no data)")
        if not torch.can_cast(value.dtype, w.dtype):
            raise TypeError(
                f"{name}: a {value.dtype} value cannot be stored in a {w.dtype} weight without losing data"
            )
        value = value.detach().to(device="cpu", dtype=w.dtype)
        loaded = seq.loaded.get(store.index)
        if loaded is not None and not loaded.ready:
            # A prefetch in flight reads the host store: let it finish (and
            # bind), so that the write below is not torn into it and the
            # device copy is updated too. A failed one is released: the
            # next load reads the new weights.
            try:
                seq.ensure(store.index)
            except Exception:
                logger.debug("prefetch of layer %d failed before an update", store.index, exc_info=True)
        if w.store == MAPPED:
            # An owned tensor of its own (the strided store's kind), same
            # layout and extent: the mapping is left as it is.
            with torch.inference_mode(False):
                w.host = torch.empty_strided(w.shape, w.stride, dtype=w.dtype)
            w.host.copy_(value)
            w.store = STRIDED
            store.invalidate()
            pages.forget(store.index)
            seq.loads.forget(store.index)
        else:
            if device.type == "cuda" and store.pinned and w.store == CONSOLIDATED and not settled:
                # A pinned store is copied by DMA straight from it, when the
                # device reaches the copy - not when it was queued: a copy
                # still pending (a released layer, a forward the host has
                # run ahead of) would read this write into a forward queued
                # before the update. Staged and strided sources were read
                # into the staging slots before their copies were queued.
                torch.cuda.synchronize(device)
                settled = True
            w.host.copy_(value)
        if seq.is_loaded(store.index):
            if seq.loads.copies:
                seq.loads.value(w, seq.loaded[store.index]).copy_(value)
            else:
                seq.slots.bind(w, w.host)
        elif seq.slots.in_place or not seq.slots.engaged:
            w.param.data = w.host
