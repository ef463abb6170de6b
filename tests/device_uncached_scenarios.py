"""Scenarios for test_device_uncached_cuda.py: each runs in a child interpreter.

The device target reading uncached (``DeviceCopies`` with an ``UncachedSource``) on the CUDA
side, driven through the stand-in runtime
(tests/fakecuda) without torch's CUDA: the layer's "device buffers" are the
stand-in's device memory, the compute stream is a stand-in stream, and the
manager's calls (``start``, ``ready``, ``release``) are made in the order its
hooks make them. The stand-in's engine reads a pinned source only when it
reaches the copy, so an uncached buffer given back (and read into again)
before the copies from it ran shows up as wrong bytes on the device.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import warnings

import torch

from fakecuda import ENV, FakeCuda, cudaErrorMemoryAllocation, hold_stream

LAYER = 256 * 1024 + 100  # bytes of one layer's weights (two weights per layer)
LAYERS = 4


class _Pages:
    """The page-cache side, reduced to what the uncached path asks: every layer streams."""

    def __init__(self, extents: list) -> None:
        self._extents = extents

    def spans(self, i):
        return None

    def streams(self, i) -> bool:
        return True

    def extents(self, i) -> list:
        return self._extents[i]

    def check(self, i) -> None:
        pass

    def let_go(self, i):
        return None

    def before_streamed_read(self, i) -> None:
        pass

    def before_cached_copy(self, i) -> None:
        pass


class _DeviceBuffer:
    """Stand-in device memory with a tensor's ``data_ptr``/``numel``."""

    def __init__(self, fake: FakeCuda, nbytes: int) -> None:
        self.ptr, self.nbytes = fake.malloc(nbytes), nbytes
        ctypes.memset(self.ptr, 0, nbytes)

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.nbytes


class _Pool:
    def __init__(self, fake: FakeCuda) -> None:
        self.fake, self.free, self.made = fake, [], 0

    def take(self, nbytes: int):
        for b in self.free:
            if b.nbytes == nbytes:
                self.free.remove(b)
                return b
        self.made += 1
        return _DeviceBuffer(self.fake, nbytes)

    def give(self, buf) -> None:
        self.free.append(buf)

    def clear(self) -> None:
        self.free.clear()


class Setup:
    """A checkpoint file of LAYERS layers mapped read-only, and a device target reading uncached
    on the stand-in."""

    def __init__(self, folder: str, buffers: int, *, fail_register: bool = False) -> None:
        from mapoffload import _core
        from mapoffload.offload.device_copies import DeviceCopies
        from mapoffload.offload.loads import UncachedSource
        from mapoffload.pagecache.pages import Extent
        from mapoffload.offload.stores import MAPPED, LayerStore, Weight
        from mapoffload.copier import Copier

        self.fake = fake = FakeCuda(os.environ[ENV])
        fake.reset()
        if fail_register:
            fake.fail("cudaHostRegister", error=cudaErrorMemoryAllocation, times=-1)
        self.stream = fake.stream_create()
        self.path = os.path.join(folder, "layers.bin")
        rng = random.Random(7)
        self.data = rng.randbytes(4096 + LAYERS * (LAYER + 4096))
        with open(self.path, "wb") as f:
            f.write(self.data)
        self.file = open(self.path, "rb")
        self.map = mmap.mmap(self.file.fileno(), 0, prot=mmap.PROT_READ)
        # The mapped weights: two per layer (the second at an odd place), as host views of the mapping.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: nothing writes it
            mapping = torch.frombuffer(memoryview(self.map), dtype=torch.uint8)
        self.stores, extents, self.places = [], [], []
        for i in range(LAYERS):
            first = 4096 + i * (LAYER + 4096) + 3
            sizes = [LAYER // 2 - 3, LAYER - LAYER // 2]
            weights, off, dev = [], first, 0
            for k, n in enumerate(sizes):
                w = Weight(names=[f"blocks.{i}.w{k}"], param=None, holders=[], dtype=torch.uint8, shape=(n,),
                           stride=(1,), nbytes=n, contiguous=True, store=MAPPED, host=mapping[off:off + n],
                           dev_offset=dev)
                weights.append(w)
                self.places.append((i, off, dev, n))
                off += n + 1  # a byte between the weights: never copied
                dev += (n + 255) // 256 * 256
            self.stores.append(LayerStore(index=i, name=f"blocks.{i}", weights=weights,
                                          dev_bytes={torch.uint8: dev}))
            extents.append([Extent(_File(self.file.fileno(), self.path), self.path, first, off - 1)])
        native = _core.Copier(device=0, mode="staged", threads=2, slot_bytes=64 * 1024, slots=2)
        copier = Copier.__new__(Copier)  # the Python face, without torch's CUDA
        copier._native, copier.device = native, torch.device("cuda", 0)
        self.copier = copier
        self.pool = _Pool(fake)
        self.pages = _Pages(extents)
        stream = self.stream

        class OnTheStandIn(DeviceCopies):
            def compute_stream(self):
                return stream

        # Copies on the given stream (no side stream: no torch CUDA), into the stand-in's buffers.
        self.loads = OnTheStandIn(self.stores, self.pages, torch.device("cuda", 0), copier, owns_copier=False,
                                  side_stream=False, pool=self.pool)
        self.loads.source = UncachedSource(self.stores, self.pages, buffers, pin_device=0)
        self.reader = self.loads.source.reader
        torch.cuda.synchronize = lambda device=None: fake.device_synchronize()  # close() syncs the device

    def expected(self, i: int, buf: _DeviceBuffer) -> bytes:
        out = bytearray(buf.nbytes)
        for layer, off, dev, n in self.places:
            if layer == i:
                out[dev:dev + n] = self.data[off:off + n]
        return bytes(out)

    def landed(self, buf: _DeviceBuffer) -> bytes:
        return ctypes.string_at(buf.ptr, buf.nbytes)

    def close(self) -> None:
        self.loads.close()
        self.copier.close()


class _File:
    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path


def scenario_buffer_waits_for_the_device_copies(folder: str) -> None:
    """Copies DMA straight from the pinned buffer; the buffer goes back only once they are done."""
    s = Setup(folder, buffers=1)
    fake, loads, reader = s.fake, s.loads, s.reader
    gate = hold_stream(fake, s.stream, timeout=20)  # the engine waits: the copies are queued, not done
    loaded = loads.start(0)
    loads.ready(0, loaded)  # stream-ordered: returns once the copies are queued
    job = loaded.uncached
    assert job.buffer.pinned and not job.done() and not job.returned
    assert reader.leased == 1 and loads.source.outstanding == 1  # ready() did not give the buffer back
    other = loads.start(1)  # the one buffer is taken: layer 1 goes through its mapping, nothing waits
    assert other.uncached is None
    try:
        reader.read(s.path, 0, 4096, timeout=0.05)
        raise AssertionError("a read took the buffer the device copies still read")
    except TimeoutError:
        pass
    gate.set()
    loads.release(0, loaded)  # waits for the copies to complete, then gives the buffer back
    assert job.returned and reader.leased == 0 and loads.source.outstanding == 0
    dev0 = loaded.buffers[torch.uint8]
    assert s.landed(dev0) == s.expected(0, dev0)
    loads.ready(1, other)
    loads.release(1, other)
    stats = s.copier.stats()
    assert stats.unstaged_bytes == s.stores[0].nbytes, stats  # layer 0 from the pinned buffer, no staging
    assert fake.stat("pageable_snapshots") == 0  # the runtime never staged a pageable source
    registered = fake.stat("live_registered")
    assert registered == reader.stats()["allocations"] == 1
    s.close()
    assert fake.stat("live_registered") == 0 and reader.held_bytes == 0
    print("ok")


def scenario_early_release_is_caught(folder: str) -> None:
    """The control: a buffer given back before its copies ran is read into again, and the device gets the
    wrong bytes - what the ordering above prevents."""
    s = Setup(folder, buffers=1)
    gate = hold_stream(s.fake, s.stream, timeout=20)
    loaded = s.loads.start(0)
    s.loads.ready(0, loaded)
    job = loaded.uncached
    buf = job.buffer
    base = buf.data.data_ptr()
    job.returned = True
    s.loads.source.outstanding -= 1
    buf.release()  # too early
    e = s.pages.extents(1)[0]
    with s.reader.read(s.path, e.first, e.end) as again:  # the same buffer, other bytes (layer 1's)
        assert again.data.data_ptr() == base
    gate.set()
    loaded.uncached.wait()
    dev0 = loaded.buffers[torch.uint8]
    assert s.landed(dev0) != s.expected(0, dev0), "the stand-in did not catch a buffer reused under its copies"
    s.loads.release(0, loaded)
    s.close()
    print("ok")


def scenario_forwards(folder: str, depth: int, register: bool) -> None:
    """Forwards in the hooks' order (ready i, prefetch i+1..i+depth, release i) on a slow engine: every layer's
    bytes land; the buffers are reused; every registration is undone at close. Without registration (refused),
    the copies from the pageable buffer are staged."""
    s = Setup(folder, buffers=1 + depth, fail_register=not register)
    s.fake.set_delay_us(300)
    loads, reader = s.loads, s.reader
    for _ in range(3):
        inflight = {}
        for i in range(LAYERS):
            if i not in inflight:
                inflight[i] = loads.start(i)
            loaded = inflight[i]
            loads.ready(i, loaded)
            for j in range(i + 1, min(LAYERS, i + 1 + depth)):
                if j not in inflight:
                    inflight[j] = loads.start(j)
            s.fake.stream_synchronize(s.stream)  # the "compute" reads the layer
            buf = loaded.buffers[torch.uint8]
            assert s.landed(buf) == s.expected(i, buf), f"layer {i}"
            loads.release(i, inflight.pop(i))
        assert reader.leased == 0 and loads.source.outstanding == 0
    stats = reader.stats()
    assert stats["reads"] == 3 * LAYERS, stats
    assert stats["allocations"] <= 1 + depth
    copied = s.copier.stats()
    if register:
        assert s.fake.stat("live_registered") == stats["allocations"] and reader.pinned_bytes == reader.held_bytes
        assert copied.unstaged_bytes == 3 * sum(st.nbytes for st in s.stores)
    else:
        assert stats["pin_failures"] == stats["allocations"] and reader.pinned_bytes == 0
        assert copied.unstaged_bytes == 0  # staged through the copier's pinned slots
    assert s.fake.stat("pageable_snapshots") == 0
    s.close()
    assert s.fake.stat("live_registered") == 0
    print("ok")
