"""Page-locking host memory through the native CUDA loader (``_core.host_register``,
``_core.HostPin``) and the uncached buffers that use it
(``UncachedReader(pin_device=)``), under the stand-in runtime (tests/fakecuda):
registered once, unregistered exactly once - on ``unregister()``, when the
reader closes or is dropped, when a buffer grows, comes back after close or is
dropped unreleased - and never in a forked child."""

from __future__ import annotations

import gc
import logging
import os
import weakref

import pytest
import torch

from mapoffload import CudaError
from mapoffload.pagecache.uncached_read import UncachedReader
from mapoffload._native import _core

from fakecuda import cudaErrorMemoryAllocation

MIB = 1 << 20


@pytest.fixture
def fake(fakecuda_runtime):
    return fakecuda_runtime


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "weights.bin"
    data = os.urandom(9 * MIB + 123)
    path.write_bytes(data)
    return path, data


def _registered(fake) -> int:
    return fake.stat("live_registered")


def test_register_and_unregister(fake):
    t = torch.empty(2 * 4096, dtype=torch.uint8)
    _core.host_register(t.data_ptr(), t.numel(), device=0)
    assert _registered(fake) == 1
    with pytest.raises(CudaError, match="cudaHostRegister"):
        _core.host_register(t.data_ptr(), 4096)  # already registered: the runtime's error, named
    _core.host_unregister(t.data_ptr())
    assert _registered(fake) == 0
    with pytest.raises(CudaError, match="cudaHostUnregister"):
        _core.host_unregister(t.data_ptr())
    with pytest.raises(ValueError, match="null address"):
        _core.host_register(0, 4096)


def test_a_pin_unregisters_once_then_lets_its_owner_go(fake):
    t = torch.empty(4096, dtype=torch.uint8)
    owner_gone = []
    weakref.finalize(t, lambda: owner_gone.append(_registered(fake)))
    pin = _core.HostPin(t.data_ptr(), 4096, device=0, owner=t)
    assert pin.registered and (pin.ptr, pin.nbytes) == (t.data_ptr(), 4096) and _registered(fake) == 1
    del t
    gc.collect()
    assert not owner_gone  # the pin holds the memory's owner
    pin.unregister()
    pin.unregister()  # idempotent
    assert not pin.registered and _registered(fake) == 0 and fake.stat("cudaHostUnregister") == 1
    del pin
    gc.collect()
    assert owner_gone == [0] and fake.stat("cudaHostUnregister") == 1  # not again at collection

    t = torch.empty(4096, dtype=torch.uint8)
    weakref.finalize(t, lambda: owner_gone.append(_registered(fake)))
    pin = _core.HostPin(t.data_ptr(), 4096, owner=t)
    del t, pin  # collected while registered: unregistered first, then the owner let go
    gc.collect()
    assert owner_gone == [0, 0] and _registered(fake) == 0


def test_a_refused_registration_raises_and_holds_nothing(fake):
    t = torch.empty(4096, dtype=torch.uint8)
    fake.fail("cudaHostRegister", error=cudaErrorMemoryAllocation)
    with pytest.raises(CudaError):
        _core.HostPin(t.data_ptr(), 4096, owner=t)
    assert _registered(fake) == 0


def test_reader_buffers_are_pinned_reused_and_unregistered_on_close(fake, data_file):
    path, data = data_file
    r = UncachedReader(buffers=2, pin_device=0)
    for _ in range(3):  # three "forwards" over the same layers: one buffer, registered once
        for k in range(3):
            with r.read(path, k * 2 * MIB + 1, (k + 1) * 2 * MIB) as buf:
                assert buf.pinned and bytes(buf.tensor().numpy()) == data[k * 2 * MIB + 1:(k + 1) * 2 * MIB]
    assert r.stats()["allocations"] == 1 and fake.stat("cudaHostRegister") == 1 and _registered(fake) == 1
    assert r.pinned_bytes == r.held_bytes == 2 * MIB
    a = r.read(path, 0, MIB)
    b = r.read_async(path, MIB, 5 * MIB).result(timeout=30)  # a second buffer (4 MiB), pinned on the worker
    assert a.pinned and b.pinned and _registered(fake) == 2 and r.pinned_bytes == 6 * MIB
    a.release()
    r.close()  # the free buffer is unregistered now; the leased one stays valid, registered, for its holder
    assert _registered(fake) == 1 and bytes(b.tensor()[:10].numpy()) == data[MIB:MIB + 10]
    b.release()  # back after close: dropped, unregistered
    assert _registered(fake) == 0 and r.pinned_bytes == 0 and r.held_bytes == 0


def test_a_grown_buffer_is_unregistered_before_it_goes(fake, data_file):
    path, _ = data_file
    with UncachedReader(buffers=1, pin_device=0) as r:
        with r.read(path, 0, MIB):
            pass
        with r.read(path, 0, 5 * MIB) as buf:  # the free 2 MiB buffer grows to 6 MiB
            assert buf.pinned and buf.data.numel() == 6 * MIB
        assert fake.stat("cudaHostRegister") == 2 and fake.stat("cudaHostUnregister") == 1
        assert _registered(fake) == 1 and r.pinned_bytes == 6 * MIB
    assert _registered(fake) == 0


def test_a_dropped_reader_and_a_dropped_buffer_unregister(fake, data_file):
    path, _ = data_file
    r = UncachedReader(buffers=2, pin_device=0)
    keep = r.read(path, 0, MIB)
    lost = r.read(path, 0, MIB)
    assert _registered(fake) == 2
    keep.release()
    del lost  # dropped without release(): its buffer (and lock) go with it
    gc.collect()
    assert _registered(fake) == 1 and r.pinned_bytes == 2 * MIB
    del r  # never closed
    gc.collect()
    assert _registered(fake) == 0


def test_a_refused_registration_leaves_the_buffer_pageable_and_says_so(fake, data_file, caplog):
    path, data = data_file
    fake.fail("cudaHostRegister", error=cudaErrorMemoryAllocation)
    with caplog.at_level(logging.WARNING, logger="mapoffload"), UncachedReader(pin_device=0) as r:
        with r.read(path, 3, MIB) as buf:
            assert not buf.pinned and bytes(buf.tensor().numpy()) == data[3:MIB]
        assert r.stats()["pin_failures"] == 1 and r.pinned_bytes == 0 and "cudaHostRegister" in r.pin_why
    assert "could not be page-locked" in caplog.text
    assert _registered(fake) == 0


def test_unpinned_readers_never_call_the_runtime(fake, data_file):
    path, _ = data_file
    with UncachedReader() as r, r.read(path, 0, MIB) as buf:
        assert not buf.pinned
    assert fake.stat("cudaHostRegister") == 0


def test_a_forked_child_unregisters_nothing(fake, data_file):
    """Page locks are not inherited: in a child the pins are not registered, and dropping them calls nothing."""
    path, data = data_file
    r = UncachedReader(buffers=2, pin_device=0)
    free = r.read(path, 0, MIB)
    held = r.read(path, MIB, 2 * MIB)
    free.release()
    t = torch.empty(4096, dtype=torch.uint8)
    pin = _core.HostPin(t.data_ptr(), 4096, owner=t)
    assert _registered(fake) == 3
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            fake.set_fork_check(False)  # so that a call the child made would be counted
            before = fake.stat("cudaHostUnregister")
            ok = not pin.registered and r.pinned_bytes == 0
            pin.unregister()
            held.release()
            with r.read(path, 5, 100) as b:  # the child reads with its own worker, into the parent's buffers
                ok = ok and bytes(b.tensor().numpy()) == data[5:100] and not b.pinned
            r.close()
            del pin
            gc.collect()
            code = 0 if ok and fake.stat("cudaHostUnregister") == before else 2
        finally:
            os._exit(code)
    from child import reap

    assert reap(pid, 30) == 0
    assert pin.registered and _registered(fake) == 3  # the parent's locks are untouched
    pin.unregister()
    held.release()
    r.close()
    assert _registered(fake) == 0


def test_pinned_layer_stores_register_through_the_loader_and_survive_a_refusal(fake, caplog):
    """The manager's pinned layer stores (``stores._pin_exact``): registered once,
    unregistered when the buffer goes; a refusal leaves the buffer pageable (its
    copies staged), logged, and no CUDA error behind for torch's next launch check."""
    from mapoffload.offload import stores

    buf, pinned = stores._pin_exact(3 * 4096 + 5, device=0)
    assert pinned and _registered(fake) == 1
    del buf
    gc.collect()
    assert _registered(fake) == 0
    fake.fail("cudaHostRegister", error=cudaErrorMemoryAllocation)
    with caplog.at_level(logging.DEBUG, logger="mapoffload"):
        buf, pinned = stores._pin_exact(4096, device=0)
    assert not pinned and _registered(fake) == 0
    assert "could not be page-locked" in caplog.text
    assert fake.peek_at_last_error() == 0
    assert buf.numel() == 4096
