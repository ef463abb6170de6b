"""The copy engine through its CPU twin: byte-exactness, copy-on-write, cold
pages, SIGBUS, concurrency, shutdown, settings."""

from __future__ import annotations

import errno
import mmap
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from mapoffload import Copier, MappingFaultError, cow_report

from conftest import drop_page_cache

SLOT = 16 * 1024


@pytest.fixture(params=["staged", "direct"])
def copier(request):
    with Copier("cpu", request.param, threads=3, staging_bytes=SLOT, slots=2) as c:
        yield c


SIZES = [0, 1, 7, 4095, 4096, 4097, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT, 40 * SLOT + 13]


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_byte_exact_for_every_size(copier, offset):
    base = torch.randint(0, 256, (sum(SIZES) + 64,), dtype=torch.uint8)
    srcs, dsts, pos = [], [], 0
    for n in SIZES:
        srcs.append(base[pos + offset : pos + offset + n])
        dsts.append(torch.zeros(n + 2 * offset, dtype=torch.uint8)[offset : offset + n])
        pos += n + 1
    copier.copy(dsts, srcs).wait()
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_thousands_of_tiny_spans(copier):
    srcs = [torch.randint(0, 256, (int(n),), dtype=torch.uint8) for n in torch.randint(1, 200, (3000,))]
    dsts = [torch.empty_like(s) for s in srcs]
    h = copier.copy(dsts, srcs)
    h.wait()
    assert h.done()
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    stats = copier.stats()
    assert stats.bytes == sum(s.nbytes for s in srcs)
    if copier.mode == "staged":
        assert stats.units < len(srcs) // 10  # small spans share slots


def test_mapped_checkpoint_copies_leave_no_anonymous_pages(tmp_path, copier):
    path = tmp_path / "w.safetensors"
    save_file({f"w{i}": torch.randn(1000 + i * 37) for i in range(40)}, path)
    loaded = load_file(path)
    srcs = list(loaded.values())
    before = cow_report(srcs).anonymous_bytes
    dsts = [torch.empty_like(s) for s in srcs]
    for _ in range(3):
        copier.copy(dsts, srcs).wait()
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    assert cow_report(srcs).anonymous_bytes == before == 0


def test_cold_pages_copy_correctly(tmp_path, copier):
    path = tmp_path / "cold.safetensors"
    expected = torch.randn(2 << 20)
    save_file({"w": expected}, path)
    drop_page_cache(path)
    w = load_file(path)["w"]
    out = torch.empty_like(w)
    copier.copy([out], [w]).wait()
    assert torch.equal(out, expected)


def test_truncated_file_raises_and_the_process_lives(tmp_path, copier):
    path = tmp_path / "trunc.bin"
    path.write_bytes(os.urandom(64 * 4096))
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    src = torch.frombuffer(m, dtype=torch.uint8)
    os.truncate(path, 4096)
    dst = torch.empty_like(src)
    with pytest.raises(MappingFaultError, match=r"bytes 0-262144 of a mapped file") as info:
        copier.copy([dst], [src]).wait()
    assert info.value.filename == str(path)
    assert info.value.errno == errno.EIO
    assert copier.stats().faults >= 1
    # Still usable afterwards.
    a = torch.randn(50000)
    b = torch.empty_like(a)
    copier.copy([b], [a]).wait()
    assert torch.equal(a, b)
    del src
    m.close()


def test_two_copiers_and_concurrent_calls_do_not_interfere():
    with Copier("cpu", threads=2, staging_bytes=SLOT, slots=3) as c1, Copier("cpu", threads=2, staging_bytes=SLOT) as c2:
        errors = []

        def run(c, seed):
            try:
                g = torch.Generator().manual_seed(seed)
                for _ in range(5):
                    srcs = [torch.randn(int(n), generator=g) for n in torch.randint(1, 20000, (20,), generator=g)]
                    dsts = [torch.empty_like(s) for s in srcs]
                    c.copy(dsts, srcs).wait()
                    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(c, i)) for i, c in enumerate([c1, c2, c1, c2])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors


def test_close_waits_or_cancels_cleanly():
    src = torch.randn(4 << 20)
    c = Copier("cpu", threads=1, staging_bytes=4096, slots=1)
    outs = [torch.empty_like(src) for _ in range(4)]
    handles = [c.copy([o], [src]) for o in outs]
    c.close()  # waits for queued work
    for h, o in zip(handles, outs):
        h.wait()
        assert torch.equal(o, src)
    assert c.closed
    with pytest.raises(RuntimeError, match="closed"):
        c.copy([outs[0]], [src])

    c = Copier("cpu", threads=1, staging_bytes=4096, slots=1)
    handles = [c.copy([torch.empty_like(src)], [src]) for _ in range(4)]
    c.close(cancel=True)
    results = []
    for h in handles:
        try:
            h.wait()
            results.append("done")
        except RuntimeError as exc:
            assert "closed before this copy ran" in str(exc)
            results.append("cancelled")
    assert "cancelled" in results
    assert all(h.done() for h in handles)


def test_validation_names_the_pair():
    with Copier("cpu") as c:
        with pytest.raises(ValueError, match="pair 1: destination has 8 bytes, source 4"):
            c.copy([torch.zeros(1), torch.zeros(2)], [torch.zeros(1), torch.zeros(1)])
        with pytest.raises(ValueError, match="pair 0: tensors must be contiguous"):
            c.copy([torch.zeros(2, 2)], [torch.zeros(2, 2).t()])
        with pytest.raises(ValueError, match="1 destinations for 2 sources"):
            c.copy([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
        with pytest.raises(ValueError, match="pair 0: destination is on meta"):
            c.copy([torch.empty(1, device="meta")], [torch.zeros(1)])
        h = c.copy([], [])
        h.wait()
        assert h.done()
    with pytest.raises(ValueError, match="mode must be"):
        Copier("cpu", "sideways")


def test_settings_from_arguments_and_environment(monkeypatch):
    monkeypatch.setenv("MAPOFFLOAD_COPY_THREADS", "3")
    monkeypatch.setenv("MAPOFFLOAD_STAGING_MIB", "2")
    monkeypatch.setenv("MAPOFFLOAD_STAGING_SLOTS", "5")
    with Copier("cpu") as c:
        assert (c.threads, c.staging_bytes, c.slots) == (3, 2 << 20, 5)
    with Copier("cpu", threads=1, staging_bytes=10000, slots=2) as c:
        assert (c.threads, c.slots) == (1, 2) and c.staging_bytes == 12288  # page-rounded
        assert "Copier(device='cpu'" in repr(c)
    monkeypatch.setenv("MAPOFFLOAD_COPY_THREADS", "many")
    with pytest.raises(ValueError, match="MAPOFFLOAD_COPY_THREADS"):
        Copier("cpu")


def test_advise_and_stats(tmp_path):
    path = tmp_path / "adv.safetensors"
    save_file({"w": torch.randn(1 << 20)}, path)
    w = load_file(path)["w"]
    with Copier("cpu", threads=2) as c:
        c.advise([w, torch.zeros(3), torch.empty(0)])
        out = torch.empty_like(w)
        c.copy([out], [w]).wait()
        s = c.stats()
        assert s.jobs == 1 and s.bytes == w.nbytes and s.read_seconds > 0
    assert torch.equal(out, w)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_cuda_byte_exact_and_stream_order(tmp_path, mode):
    path = tmp_path / "g.safetensors"
    tensors = {f"w{i}": torch.randn(n) for i, n in enumerate([1, 1023, 4096, 3 << 20, 17])}
    save_file(tensors, path)
    loaded = load_file(path)
    srcs = list(loaded.values())
    before = cow_report(srcs).anonymous_bytes
    stream = torch.cuda.Stream()
    with Copier("cuda", mode, staging_bytes=1 << 20, slots=3) as c:
        dsts = [torch.empty_like(s, device="cuda") for s in srcs]
        with torch.cuda.stream(stream):
            h = c.copy(dsts, srcs, stream=stream)
            h.wait()
            # A kernel enqueued after wait() on that stream sees the data.
            sums = [d.double().sum() for d in dsts]
        stream.synchronize()
        for s, d, t in zip(srcs, dsts, sums):
            assert torch.equal(d.cpu(), s)
            assert float(t) == pytest.approx(float(s.double().sum()))
    if mode == "staged":
        assert cow_report(srcs).anonymous_bytes == before


@pytest.mark.cuda
def test_cuda_direct_and_staged_agree():
    src = torch.randn(5 << 20)
    outs = []
    for mode in ("direct", "staged"):
        with Copier("cuda", mode) as c:
            d = torch.empty_like(src, device="cuda")
            c.copy([d], [src]).wait()
            torch.cuda.current_stream().synchronize()
            outs.append(d.cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], src)


@pytest.mark.cuda
def test_cuda_wait_stream_orders_a_kernel_after_the_copies_without_a_host_wait():
    src = torch.randn(8 << 20)
    pinned = torch.randn(1 << 20).pin_memory()
    copy_stream, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    with Copier("cuda", "staged", staging_bytes=1 << 20, slots=2) as c:
        d1, d2 = torch.empty_like(src, device="cuda"), torch.empty_like(pinned, device="cuda")
        h = c.copy([d1, d2], [src, pinned], stream=copy_stream)  # the pinned source goes by DMA directly
        h.wait_stream(compute)  # the host waits only for the enqueue
        total = d1.double().sum() + d2.double().sum()  # queued on compute, after the copies
        assert float(total) == pytest.approx(float(src.double().sum() + pinned.double().sum()))
        assert c.stats().unstaged_bytes == pinned.nbytes
        assert h.done() or (h.wait() is None and h.done())


@pytest.mark.cuda
def test_cuda_placeholders_report_cuda_and_the_model_comes_back_whole():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = model(x)
    from mapoffload import LayerwiseOffloadManager

    with LayerwiseOffloadManager(model, model, device="cuda", prefetch_layers=2) as mgr:
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        mgr.register_forward_hooks()
        with torch.no_grad():
            for _ in range(3):
                assert torch.allclose(model(x.cuda()).cpu(), want)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_cuda_requested_without_a_device_is_a_clear_error():
    from mapoffload import cuda_available

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    if not os.environ.get("MAPOFFLOAD_CUDART"):  # the suite's stand-in runtime reports a device
        assert cuda_available() is False
    with pytest.raises(RuntimeError, match="no CUDA device"):
        Copier("cuda")
    with pytest.raises(ValueError, match="cuda or cpu"):
        Copier("meta")


def test_copy_spans_takes_unstaged_and_no_old_name():
    # Never released: direct= (unstaged='s old name) and CopyStats.direct_bytes are gone, not kept.
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    with Copier("cpu", "staged", threads=1, staging_bytes=SLOT, slots=2) as c:
        dst = torch.zeros_like(src)
        c.copy_spans([dst.data_ptr()], [src.data_ptr()], [src.nbytes], keepalive=(src, dst), unstaged=[False]).wait()
        assert torch.equal(dst, src)
        with pytest.raises(TypeError, match="unexpected keyword argument 'direct'"):
            c.copy_spans([dst.data_ptr()], [src.data_ptr()], [src.nbytes], keepalive=(src, dst), direct=[False])
        assert not hasattr(c.stats(), "direct_bytes")
