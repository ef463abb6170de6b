"""Reading file bytes around the page cache (csrc/uncached_read.*, mapoffload/pagecache/uncached_read.py).

The bytes are the file's for every alignment and size, on both paths; a
truncated file is a MappingFaultError naming it; filesystems without O_DIRECT
(tmpfs on purpose, ramfs, an injected refusal) read buffered and say so; the
``O_DIRECT`` path leaves the page cache empty; buffers are reused and bounded; the
inode read is the one held, whatever its path names since.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading

import pytest
import torch

from mapoffload import MappingFaultError, drop_page_cache
from mapoffload._core import O_DIRECT_ALIGN, uncached_span, file_resident_bytes, open_for_reading, read_ranges
from mapoffload.pagecache.uncached_read import UncachedReader
from mapoffload._native import _core

MIB = 1 << 20


def _write(path, nbytes: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


@pytest.fixture
def disk_file(tmp_path):
    path = tmp_path / "weights.bin"
    data = _write(path, 9 * MIB + 12345)
    return path, data


@pytest.fixture(autouse=True)
def _no_injection():
    yield
    _core._inject_uncached_errors(0, 0)


def _aligned(nbytes: int) -> tuple[torch.Tensor, int]:
    raw = torch.empty(nbytes + O_DIRECT_ALIGN, dtype=torch.uint8)
    return raw, raw.data_ptr() + (-raw.data_ptr() % O_DIRECT_ALIGN)


def _is_uncached(path) -> bool:
    with UncachedReader() as r:
        return r.open(path).method == "uncached"


RANGES = {
    "aligned": (O_DIRECT_ALIGN, 2 * MIB),
    "unaligned": (4095, 3 * MIB + 7),
    "tiny": (123_457, 1),
    "one-block-straddle": (O_DIRECT_ALIGN - 2, 4),
    "multi-mib": (1, 9 * MIB),
    "to-eof-unaligned": (5 * MIB + 3, 4 * MIB + 12345 - 3),
    "empty": (77, 0),
}


@pytest.mark.parametrize("io_bytes", [O_DIRECT_ALIGN, MIB, 8 * MIB])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("uncached", [True, False], ids=["uncached", "buffered"])
def test_native_ranges_land_at_dst_plus_offset_residue(disk_file, io_bytes, threads, uncached):
    path, data = disk_file
    fd0 = os.open(path, os.O_RDONLY)
    fd, how, why = open_for_reading(fd0, uncached)
    try:
        if not uncached:
            assert (how, why) == ("buffered", "O_DIRECT not asked")
        elif "tmpfs" in why:  # where the file's pages are its storage, O_DIRECT is not used
            assert how == "buffered"
        else:
            assert (how, why) == ("uncached", "")
        offsets, lengths = [r[0] for r in RANGES.values()], [r[1] for r in RANGES.values()]
        spans = [uncached_span(o, n) for o, n in zip(offsets, lengths)]
        raw, base = _aligned(sum(spans))
        dsts, slot = [], 0
        for s in spans:
            dsts.append(base + slot)
            slot += s
        res = read_ranges([fd] * len(offsets), offsets, lengths, dsts, io_bytes=io_bytes, threads=threads)
        lead = base - raw.data_ptr()
        for (name, (o, n)), d, (method, nread) in zip(RANGES.items(), dsts, res):
            at = d - raw.data_ptr() + o % O_DIRECT_ALIGN
            assert bytes(raw[at:at + n].numpy()) == data[o:o + n], name
            assert method == how
            assert nread >= n
            if method == "uncached" and n:
                assert nread == min(uncached_span(o, n), len(data) - (o - o % O_DIRECT_ALIGN)), name
        assert lead < O_DIRECT_ALIGN
    finally:
        os.close(fd)
        os.close(fd0)


def test_native_rejects_bad_input(disk_file):
    path, _ = disk_file
    fd0 = os.open(path, os.O_RDONLY)
    fd, _, _ = open_for_reading(fd0)
    raw, base = _aligned(4 * O_DIRECT_ALIGN)
    try:
        with pytest.raises(ValueError, match="aligned"):
            read_ranges([fd], [0], [10], [base + 8])
        with pytest.raises(ValueError, match="overlap"):
            read_ranges([fd, fd], [0, 10], [10, 10], [base, base])
        with pytest.raises(ValueError, match="io_bytes"):
            read_ranges([fd], [0], [10], [base], io_bytes=1000)
        with pytest.raises(ValueError, match="threads"):
            read_ranges([fd], [0], [10], [base], threads=0)
        with pytest.raises(ValueError, match="differ in length"):
            read_ranges([fd], [0, 1], [10], [base])
        pipe_r, pipe_w = os.pipe()
        try:
            with pytest.raises(OSError) as e:
                open_for_reading(pipe_r)  # not a regular file
            assert e.value.errno == errno.EINVAL
        finally:
            os.close(pipe_r)
            os.close(pipe_w)
    finally:
        os.close(fd)
        os.close(fd0)


@pytest.mark.parametrize("name", list(RANGES))
def test_reader_bytes_equal_the_file(disk_file, name):
    path, data = disk_file
    first, n = RANGES[name]
    with UncachedReader(io_bytes=MIB) as r:
        with r.read(path, first, first + n) as buf:
            assert buf.data.data_ptr() % O_DIRECT_ALIGN == 0
            assert (buf.data.data_ptr() + buf.offset) % O_DIRECT_ALIGN == first % O_DIRECT_ALIGN
            assert bytes(buf.tensor().numpy()) == data[first:first + n]
            assert buf.methods == [r.open(path).method]


def test_views_of_a_dtype_bind_without_a_copy(disk_file):
    path, data = disk_file
    first = 3 * MIB + 24  # a float32 tensor of 1000 elements stored here
    want = torch.frombuffer(bytearray(data[first:first + 4000]), dtype=torch.float32)
    with UncachedReader() as r, r.read(path, first - 8, first + 4008) as buf:
        t = buf.view(first, first + 4000).view(torch.float32)
        assert t.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()  # a view, no copy
        assert torch.equal(t.view(torch.int32), want.view(torch.int32))  # random bits: NaNs among them
        with pytest.raises(ValueError, match="not within"):
            buf.view(first - 9, first)


def test_extents_of_two_files_share_one_buffer(tmp_path, disk_file):
    path, data = disk_file
    other = tmp_path / "shard2.bin"
    data2 = _write(other, 3 * MIB + 5, seed=1)
    with UncachedReader() as r:
        with r.read_extents([(path, 9 * MIB, len(data)), (other, 0, 2 * MIB + 1)]) as buf:
            assert bytes(buf.tensor(0).numpy()) == data[9 * MIB:]
            assert bytes(buf.tensor(1).numpy()) == data2[:2 * MIB + 1]
            assert buf.offsets[1] % O_DIRECT_ALIGN == 0


@pytest.mark.parametrize("uncached", [True, False], ids=["uncached", "buffered"])
def test_a_truncated_file_raises_naming_path_and_offset(tmp_path, uncached):
    path = tmp_path / "short.bin"
    _write(path, 2 * MIB)
    fd = os.open(path, os.O_RDONLY)
    try:
        with UncachedReader(o_direct=uncached) as r:
            f = r.open(fd)
            os.truncate(path, MIB + 100)  # under the held descriptor
            with pytest.raises(MappingFaultError) as e:
                r.read(f, MIB - 5, 2 * MIB)
            assert e.value.filename == str(path)
            msg = str(e.value)
            assert str(path) in msg and str(MIB - 5) in msg and "truncated" in msg
            assert isinstance(e.value, OSError) and e.value.errno == errno.EIO
            assert r.leased == 0  # the buffer went back
            with r.read(f, MIB, MIB + 100) as buf:  # what is left still reads
                assert buf.tensor().numel() == 100
    finally:
        os.close(fd)


def test_tmpfs_reads_buffered_and_says_so():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/mapoffload-uncached-{os.getpid()}"
    try:
        data = _write(path, 3 * MIB + 11)
        with UncachedReader() as r:
            f = r.open(path)
            if "tmpfs" not in f.why:
                pytest.skip(f"/dev/shm is not tmpfs here ({f})")
            assert f.method == "buffered"
            with r.read(f, 7, 3 * MIB + 11) as buf:
                assert buf.methods == ["buffered"]
                assert bytes(buf.tensor().numpy()) == data[7:]
            assert r.stats()["buffered_bytes"] == 3 * MIB + 4 and r.stats()["uncached_bytes"] == 0
    finally:
        os.unlink(path)


def test_ramfs_refuses_o_direct_and_reads_buffered(tmp_path):
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    try:
        data = _write(mnt / "w.bin", MIB + 3)
        fd0 = os.open(mnt / "w.bin", os.O_RDONLY)
        try:
            # The real refusal: open(O_DIRECT) is EINVAL on ramfs (reported as tmpfs/ramfs by its magic).
            with pytest.raises(OSError) as e:
                os.close(os.open(f"/proc/self/fd/{fd0}", os.O_RDONLY | os.O_DIRECT))
            assert e.value.errno == errno.EINVAL
            with UncachedReader() as r:
                f = r.open(fd0)
                assert f.method == "buffered" and f.why
                with r.read(f, 1, MIB + 3) as buf:
                    assert bytes(buf.tensor().numpy()) == data[1:]
        finally:
            os.close(fd0)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_an_open_refusing_o_direct_reads_buffered(disk_file):
    path, data = disk_file
    _core._inject_uncached_errors(errno.EINVAL, 0)
    with UncachedReader() as r:
        f = r.open(path)
        assert f.method == "buffered" and "refuses O_DIRECT" in f.why
        assert not (fcntl_flags(f.fd) & os.O_DIRECT)
        with r.read(f, 5, 2 * MIB) as buf:
            assert buf.methods == ["buffered"] and bytes(buf.tensor().numpy()) == data[5:2 * MIB]


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_pread_refusing_o_direct_falls_back_and_stays_buffered(disk_file):
    path, data = disk_file
    with UncachedReader(threads=2, io_bytes=MIB) as r:
        f = r.open(path)
        if f.method != "uncached":
            pytest.skip(f"no O_DIRECT here: {f.why}")
        assert fcntl_flags(f.fd) & os.O_DIRECT
        _core._inject_uncached_errors(0, errno.EINVAL)
        with r.read(f, 3, 5 * MIB) as buf:
            assert buf.methods == ["buffered"]
            assert bytes(buf.tensor().numpy()) == data[3:5 * MIB]
        assert f.method == "buffered" and "refused" in f.why
        assert not (fcntl_flags(f.fd) & os.O_DIRECT)  # the reader's own descriptor; later reads go buffered at once
        _core._inject_uncached_errors(0, 0)
        with r.read(f, 0, MIB) as buf:
            assert buf.methods == ["buffered"] and bytes(buf.tensor().numpy()) == data[:MIB]


def _cached(path) -> int:
    return file_resident_bytes(str(path))[0]


def test_the_o_direct_path_leaves_the_page_cache_empty(disk_file):
    path, data = disk_file
    if not _is_uncached(path):
        pytest.skip("the temporary folder has no O_DIRECT (tmpfs?)")
    drop_page_cache(path)
    if _cached(path) > 0:
        pytest.skip("the file's pages cannot be dropped here")
    with UncachedReader() as r, r.read(path, 1, len(data)) as buf:
        assert buf.method == "uncached"
        assert bytes(buf.tensor()[:MIB].numpy()) == data[1:MIB + 1]
    assert _cached(path) == 0


def test_the_buffered_path_drops_what_it_read(disk_file):
    path, data = disk_file
    if not _is_uncached(path):
        pytest.skip("the temporary folder is tmpfs: its pages are the file")
    drop_page_cache(path)
    if _cached(path) > 0:
        pytest.skip("the file's pages cannot be dropped here")
    with UncachedReader(o_direct=False) as r, r.read(path, 10, 8 * MIB + 10) as buf:
        assert buf.method == "buffered"
        assert bytes(buf.tensor().numpy()) == data[10:8 * MIB + 10]
    # Only the partial pages at the range's two ends may stay (the kernel drops whole pages).
    assert _cached(path) <= 2 * os.sysconf("SC_PAGE_SIZE")


def test_buffers_are_reused_and_bounded(disk_file):
    path, _ = disk_file
    with UncachedReader(buffers=2) as r:
        ptrs = set()
        for _ in range(3):  # three "forwards" of four layers
            for k in range(4):
                with r.read(path, k * 2 * MIB + 1, (k + 1) * 2 * MIB) as buf:
                    ptrs.add(buf.data.data_ptr())
        assert r.stats()["allocations"] == 1 and len(ptrs) == 1
        a = r.read(path, 0, MIB)
        b = r.read(path, MIB, 2 * MIB)
        assert a.data.data_ptr() != b.data.data_ptr()
        with pytest.raises(TimeoutError):
            r.read(path, 0, 10, timeout=0.05)  # both leased: the pool is bounded
        a.release()
        a.release()  # idempotent
        with pytest.raises(RuntimeError, match="released"):
            a.tensor()
        c = r.read(path, 0, 10, timeout=0.05)
        assert c.data.data_ptr() == a.data.data_ptr()
        c.release()
        b.release()
        assert r.stats()["allocations"] == 2 and r.leased == 0


def test_a_buffer_dropped_without_release_is_not_reused(disk_file):
    path, data = disk_file
    with UncachedReader(buffers=1) as r:
        buf = r.read(path, 0, MIB)
        view = buf.tensor()
        del buf  # never released: its memory stays with `view`
        with r.read(path, MIB, 2 * MIB, timeout=1) as other:
            assert other.data.data_ptr() != view.data_ptr()
        assert bytes(view.numpy()) == data[:MIB]


def test_a_larger_read_than_fixed_buffers_is_refused(disk_file):
    path, _ = disk_file
    with UncachedReader(buffer_bytes=MIB) as r:
        with pytest.raises(ValueError, match="does not fit"):
            r.read(path, 1, MIB + 1)  # the aligned superset is MiB + 4 KiB
        with r.read(path, 0, MIB) as buf:
            assert buf.data.numel() == MIB


def test_a_renamed_over_path_still_reads_the_held_inode(tmp_path):
    path = tmp_path / "ckpt.bin"
    old = _write(path, 2 * MIB + 1, seed=2)
    fd = os.open(path, os.O_RDONLY)
    try:
        new_path = tmp_path / "ckpt.bin.tmp"
        new = _write(new_path, MIB, seed=3)
        os.rename(new_path, path)  # an atomic replace, as downloaders do
        with UncachedReader() as r:
            with r.read(fd, 0, 2 * MIB + 1) as buf:
                assert bytes(buf.tensor().numpy()) == old
            with r.read(path, 0, MIB) as buf:  # the path now names the new file
                assert bytes(buf.tensor().numpy()) == new
            assert len(r.files()) == 2
        os.unlink(path)  # and after the name is gone altogether
        with UncachedReader() as r, r.read(fd, 5, 105) as buf:
            assert bytes(buf.tensor().numpy()) == old[5:105]
    finally:
        os.close(fd)


def test_async_reads_and_close(disk_file):
    path, data = disk_file
    r = UncachedReader(buffers=2)
    futs = [r.read_async(path, k * MIB, (k + 1) * MIB + 3) for k in range(2)]
    bufs = [f.result(timeout=30) for f in futs]
    for k, b in enumerate(bufs):
        assert bytes(b.tensor().numpy()) == data[k * MIB:(k + 1) * MIB + 3]
    bufs[0].release()
    r.close()
    assert bytes(bufs[1].tensor()[:10].numpy()) == data[MIB:MIB + 10]  # a leased buffer outlives close()
    bufs[1].release()
    with pytest.raises(RuntimeError, match="closed"):
        r.read(path, 0, 1)
    with pytest.raises(RuntimeError, match="closed"):
        r.read_async(path, 0, 1)
    r.close()  # idempotent


def test_close_wakes_a_read_waiting_for_a_buffer(disk_file):
    """A read waiting for a buffer when close() comes raises; the leased one stays its holder's until released."""
    path, data = disk_file
    r = UncachedReader(buffers=1)
    held = r.read(path, 0, MIB)
    raised: list[BaseException] = []

    def wait_for_one():
        try:
            r.read(path, MIB, 2 * MIB, timeout=30).release()
        except BaseException as e:  # noqa: BLE001 - what the waiter got is the assertion
            raised.append(e)

    waiter = threading.Thread(target=wait_for_one)
    waiter.start()
    waiter.join(0.3)  # in the pool's wait now
    r.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and "closed" in str(raised[0])
    assert bytes(held.tensor()[:10].numpy()) == data[:10] and r.held_bytes == held.data.numel()
    held.release()  # back after close: dropped
    assert r.leased == 0 and r.held_bytes == 0 and r.capacity_bytes == 0


def test_a_forked_child_reads_with_threads_of_its_own(disk_file):
    path, data = disk_file
    with UncachedReader(threads=2, io_bytes=MIB) as r:
        with r.read_async(path, 0, 3 * MIB).result(timeout=30) as buf:  # the parent's worker exists
            assert bytes(buf.tensor()[:100].numpy()) == data[:100]
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = 0
            try:
                with r.read_async(path, MIB, 4 * MIB + 1).result(timeout=30) as b:
                    ok = bytes(b.tensor().numpy()) == data[MIB:4 * MIB + 1]
                with r.read(path, 2, 5 * MIB) as b:
                    ok = ok and bytes(b.tensor().numpy()) == data[2:5 * MIB]
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with r.read(path, 0, 10) as b:  # the parent's reader is untouched
            assert bytes(b.tensor().numpy()) == data[:10]


@pytest.mark.parametrize("failure", ["too_large", "bad_extent", "timeout"])
def test_a_failed_asynchronous_read_leaves_a_forked_child_every_buffer(disk_file, failure):
    """An asynchronous read refused before it had a buffer is no lease of the worker's: a child forked
    after it still has every buffer (a child writes off only what the worker held at the fork)."""
    path, data = disk_file
    with UncachedReader(buffers=1, buffer_bytes=MIB) as r:
        held = r.read(path, 0, 10) if failure == "timeout" else None
        first, end, timeout = {"too_large": (0, 2 * MIB, None), "bad_extent": (5, 1, None),
                               "timeout": (0, 10, 0.05)}[failure]
        with pytest.raises((ValueError, TimeoutError)):
            r.read_async(path, first, end, timeout=timeout).result(timeout=30)
        if held is not None:
            held.release()
        assert r.leased == 0
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = False
            try:
                ok = r.leased == 0
                with r.read(path, 0, 10, timeout=1) as b:
                    ok = ok and bytes(b.tensor().numpy()) == data[:10]
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_close_does_not_wait_for_a_queued_read_stuck_on_a_buffer_its_caller_holds(disk_file):
    path, _ = disk_file
    r = UncachedReader(buffers=1)
    held = r.read(path, 0, 10)
    fut = r.read_async(path, 0, 10)  # waits for `held` on the worker
    closer = threading.Thread(target=r.close, daemon=True)
    closer.start()
    closer.join(2)
    blocked = closer.is_alive()
    held.release()  # lets the queued read have the buffer: close() returns either way
    closer.join(30)
    if fut.exception(timeout=30) is None:
        fut.result().release()
    assert not closer.is_alive() and r.leased == 0
    assert not blocked
    with pytest.raises(RuntimeError, match="closed"):  # the queued read could not have a buffer
        fut.result()


def test_reads_release_the_gil(disk_file):
    """Another Python thread runs while a read is in the kernel (the GIL is released).

    With a long switch interval the ticker can take the GIL only when the reading
    thread lets it go of its own accord (a C++ call holding it is never preempted),
    so a tick during the call is the proof; the reader tries a few reads, since on a
    loaded machine the ticker may not get a core during one."""
    path, _ = disk_file
    import sys
    import threading

    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    t = threading.Thread(target=tick)
    t.start()
    try:
        with UncachedReader(threads=1, io_bytes=O_DIRECT_ALIGN) as r:  # many small I/Os: a long call
            ran = False
            for _ in range(5):
                before = len(ticks)
                with r.read(path, 0, 4 * MIB):
                    pass
                if len(ticks) > before:
                    ran = True
                    break
            assert ran
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)

