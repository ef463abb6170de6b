"""A layer whose tensors are apart in its file (safetensors orders tensors by
dtype first: an fp8 layer's float32 scales sit with every layer's scales at
the start, its codes at the end) is read and let go by its own byte runs,
not by one range from its first byte to its last - which held most of the
file: letting a streamed layer go dropped the cached ones, and reading it
around the page cache read the file (issue 17 at base + 50 %: 1.1 GB read a
forward for 73 MiB streamed)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from torch import nn

from mapoffload import LayerwiseOffloadManager, empty_weights, load_checkpoint, resident_bytes

from stacks import drain, save_reference, warm_read_bytes
LAYERS, WIDTH = 10, 512  # 1 MiB of float32 weight and 1 KiB of float16 gain a layer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, bias=False)
        self.gain = nn.Parameter(torch.ones(WIDTH, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain.float()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    ref = Stack()
    with torch.no_grad():
        for b in ref.blocks:
            b.gain.uniform_(0.5, 1.5)
    return save_reference(ref, torch.randn(3, WIDTH), tmp_path_factory.mktemp("runs") / "stack.safetensors")


def _mapped(path) -> Stack:
    with empty_weights():
        model = Stack()
    load_checkpoint(model, path, keep_mapping=True)
    return model


def _layer_bytes(model: Stack, i: int) -> int:
    return sum(p.nbytes for p in model.blocks[i].parameters())


def test_the_checkpoint_puts_a_layers_tensors_apart(ckpt):
    # The premise: the float16 gains are together, away from their layers' weights.
    path, _, _ = ckpt
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    w = header["blocks.0.lin.weight"]["data_offsets"]
    g = header["blocks.0.gain"]["data_offsets"]
    assert abs(g[0] - w[0]) > 4 << 20, (w, g)  # more than the layer apart: other layers between


def test_a_layers_extents_are_its_own_runs(ckpt):
    path, _, _ = ckpt
    model = _mapped(path)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", reads="mapping") as mgr:
        for i in range(LAYERS):
            runs = mgr.parts.pages.extents(i)
            assert len(runs) == 2, [(e.first, e.end) for e in runs]
            # Only its own bytes: nothing of another layer between a run's ends.
            assert sum(e.end - e.first for e in runs) == _layer_bytes(model, i)


@pytest.mark.parametrize("caps", [None, "no-pageout"])
def test_letting_a_streamed_layer_go_keeps_the_cached_ones(ckpt, caps):
    # Without MADV_PAGEOUT (or when it leaves pages) a let-go drops the layer's
    # file bytes with fadvise: by its runs, never the cached layers between them
    # (their pages mapped here survive a drop anyway: this guards the property,
    # the two tests around it reproduce the defect).
    path, x, want = ckpt
    model = _mapped(path)
    layer = _layer_bytes(model, 0)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=5 * layer + 8192,
                                 reads="mapping", kernel_caps=caps) as mgr:
        plan = mgr.residency
        assert plan.cached and plan.streamed
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), want)
        drain(mgr)
        hosts = dict(mgr.iter_cpu_weights())
        for i in plan.cached:
            held = sum(resident_bytes([hosts[f"blocks.{i}.lin.weight"], hosts[f"blocks.{i}.gain"]]))
            assert held == _layer_bytes(model, i), (i, held)


def test_reading_a_streamed_layer_uncached_reads_its_bytes_not_the_file(ckpt):
    path, x, want = ckpt
    model = _mapped(path)
    layer = _layer_bytes(model, 0)
    with LayerwiseOffloadManager(model, "blocks", device="cpu", page_cache_bytes=5 * layer + 8192,
                                 reads="uncached") as mgr:
        plan = mgr.residency
        mgr.register_forward_hooks()
        read = warm_read_bytes(model, x, want, path)
        # Each run read in whole aligned blocks: a page more at each end of each run.
        assert plan.streamed_bytes <= read <= plan.streamed_bytes + len(plan.streamed) * 4 * 4096 + 65536, read
        # Buffers of the layer's runs (grown in 2 MiB steps), not of the file.
        quantum = 2 << 20
        per_buffer = -(-(layer + 4 * 4096) // quantum) * quantum
        assert mgr.parts.loads.source.reader.held_bytes <= (1 + plan.depth) * per_buffer


def test_a_span_across_two_files_mapped_side_by_side_is_cut_at_the_seam(tmp_path):
    # Spans are merged by address: two files mapped back to back (mmap places new
    # mappings next to old ones) could make one span, which the extent of the first
    # file alone would have read past its mapping - other bytes, silently.
    import ctypes
    import mmap

    from mapoffload.pagecache.mapped_file import MappedFiles
    from mapoffload.pagecache.pages import file_extents, layer_spans

    page = mmap.PAGESIZE
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a" * 2 * page)
    b.write_bytes(b"b" * 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    MAP_SHARED, MAP_FIXED, PROT_READ = 0x01, 0x10, 0x1
    base = libc.mmap(None, 4 * page, PROT_READ, 0x22, -1, 0)  # an anonymous reservation of both
    assert base not in (None, ctypes.c_void_p(-1).value)
    fds = [os.open(p, os.O_RDONLY) for p in (a, b)]
    try:
        for k, fd in enumerate(fds):
            got = libc.mmap(base + 2 * k * page, 2 * page, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0)
            assert got == base + 2 * k * page
        files = MappedFiles()
        try:
            runs = file_extents(layer_spans([(base + page, 2 * page)]), files)  # the seam at base + 2 pages
            assert sorted((os.path.basename(e.path), e.first, e.end) for e in runs) == [
                ("a.bin", page, 2 * page), ("b.bin", 0, page)]
        finally:
            files.close()
    finally:
        libc.munmap(base, 4 * page)
        for fd in fds:
            os.close(fd)
