"""Page-cache advice by kernel capability (``mapoffload/pagecache/kernel.py``).

Kernels before 5.18 (Ubuntu 22.04's 5.15, RHEL 9's 5.14) read 4 KiB per
fault under ``MADV_RANDOM``: a layer read by faults is 16,384 reads per
64 MiB. The capabilities are measured at run time and can be injected; each
injected capability selects its path, checked here on this machine's kernel:
``MADV_RANDOM`` without ``MADV_HUGEPAGE`` makes this kernel read 4 KiB per
fault too, so the old-kernel path runs for real.

No timing is asserted: reads are counted as the bytes this thread submitted
(``/proc/thread-self/io`` ``read_bytes``, accounted when a read is submitted)
and the calls the read-ahead made; residency with ``mincore``.

Reclaim can take a page back at any moment (``page_cache.py``): seen here
(issue 24), 0.7 % of 64 MiB read-aheads lost 2-69 pages before the
populate that maps them began, and populate read them again, 4 KiB each.
What reclaim took back is therefore accounted (``cachestat``), never assumed
resident. A page taken while populate runs and read again by it leaves no
trace, so what populate reads is not held to zero; that every page had been
read when populate began (or read and taken back) is - it is what "populate
reads nothing" relied on. Where the machine ran short of memory meanwhile,
the read-ahead leaves what it cannot allocate to the faults (by design):
those tests are skipped, saying so.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os
import time

import pytest
import torch

from mapoffload import LayerwiseOffloadManager, drop_page_cache
from mapoffload import _log
from mapoffload._env import EnvSettingError
from mapoffload.pagecache import kernel, pages
from mapoffload.pagecache.kernel import ENV_KERNEL_CAPS, KernelCaps, kernel_caps, parse_overrides
from mapoffload.pagecache.mapped_file import MappedFiles
from mapoffload.pagecache.pages import DROPPED, PageWorker, file_extents, layer_spans
from mapoffload._native import _core

from page_cache import cachestat, memory_pressure
from stacks import LAYERS, drain, mapped

MIB = 1 << 20
PAGE = _core.page_size()
LAYER = 64 * MIB
# The layer sits page-aligned but not 2 MiB-aligned between two neighbours:
# a 2 MiB window fault at either end would read neighbour bytes.
PREV = MIB + 3 * PAGE
NEXT = MIB + 5 * PAGE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(ENV_KERNEL_CAPS, raising=False)


def _skip_if_short_of_memory(m: Mapped) -> None:
    if memory_pressure() != m.pressure:
        pytest.skip("the machine ran short of memory during the test (kswapd or direct reclaim): what the "
                    "page cache holds tells nothing then (see the module)")


def _thread_read_bytes() -> int:
    with open("/proc/thread-self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/thread-self/io")


needs_io_accounting = pytest.mark.skipif(not os.path.exists("/proc/thread-self/io"),
                                         reason="the kernel keeps no per-task I/O accounting")


def _vm_flags(addr: int) -> set[str]:
    """VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and not line.startswith("VmFlags"):
                start, end = (int(v, 16) for v in first.split("-"))
                current = start <= addr < end
            elif line.startswith("VmFlags:") and current:
                return set(line.split()[1:])
    raise AssertionError(f"{addr:#x} is not mapped")


class Mapped:
    """A file of PREV + LAYER + NEXT bytes on disk, cold, mapped private read-only."""

    def __init__(self, path, prev: int = PREV, layer: int = LAYER, nxt: int = NEXT) -> None:
        self.path, self.prev, self.layer, self.next = str(path), prev, layer, nxt
        self.size = prev + layer + nxt
        with open(self.path, "wb") as f:
            chunk = os.urandom(MIB)
            for _ in range(self.size // MIB):
                f.write(chunk)
            f.write(chunk[: self.size % MIB])
        drop_page_cache(self.path)  # fsync, then drop
        self.fd = os.open(self.path, os.O_RDONLY)
        self.addr = _libc.mmap(None, self.size, 1, 2, self.fd, 0)  # PROT_READ, MAP_PRIVATE
        assert self.addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        self.spans = layer_spans([(self.addr + prev, layer)])
        self.files = MappedFiles()
        self.extents = file_extents(self.spans, self.files)
        assert self.resident() == (0, 0, 0), "the file did not start cold"
        self.pressure = memory_pressure()  # see _skip_if_short_of_memory

    def resident(self) -> tuple[int, int, int]:
        """Resident bytes of (the neighbour before, the layer, the neighbour after)."""
        a = self.addr
        spans = _core.SpanArray([a, a + self.prev, a + self.prev + self.layer], [self.prev, self.layer, self.next])
        return tuple(_core.resident_bytes(spans))

    def cachestat(self) -> tuple[int, int] | None:
        """(pages cached, pages reclaim took back) of the layer's bytes in the file (``page_cache.cachestat``)."""
        return cachestat(self.fd, self.prev, self.layer)

    def cached(self) -> list[tuple[int, int] | None]:
        """``cachestat`` of (the neighbour before, the layer, the neighbour after)."""
        ranges = ((0, self.prev), (self.prev, self.layer), (self.prev + self.layer, self.next))
        return [cachestat(self.fd, off, n) if n else (0, 0) for off, n in ranges]  # (length 0: to the end)

    def wait_for_reads(self, timeout: float = 30.0) -> None:
        """Until no read of the layer's pages is in flight: ``cachestat`` counts a page cached from
        when its read starts, ``mincore`` once it completed (without ``cachestat``: ``read()`` it).

        Not ``read()``: it would read again what reclaim took back, through the kernel's read-ahead,
        into large folios that can cross the layer's ends.
        """
        deadline = time.monotonic() + timeout
        while (st := self.cachestat()) is not None:
            resident = self.resident()[1]  # first: a page that completes meanwhile only makes this wait longer
            if resident >= self.cachestat()[0] * PAGE:
                return
            assert time.monotonic() < deadline, (resident, st)
            time.sleep(0.001)
        assert len(os.pread(self.fd, self.layer, self.prev)) == self.layer

    def read_in(self, neighbours: bool = True) -> bool:
        """Every page of the layer is cached or was, until reclaim took it back (see the module); and
        (``neighbours``) nothing of its neighbours is or was. Without ``cachestat``: resident, exactly.

        One ``cachestat`` walk per range: a page taken back meanwhile is counted once, either way.
        """
        stats = self.cached()
        if None in stats:
            resident = self.resident()
            return resident == (0, self.layer, 0) if neighbours else resident[1] == self.layer
        got = [sum(st) * PAGE for st in stats]
        return got == [0, self.layer, 0] if neighbours else got[1] == self.layer

    def close(self) -> None:
        self.files.close()
        _libc.munmap(self.addr, self.size)
        os.close(self.fd)


@pytest.fixture
def layer_file(tmp_file_dir):
    m = Mapped(tmp_file_dir / "layer.bin")
    yield m
    m.close()


class SpyCore:
    """``_core`` as pages.py sees it, recording the calls that read and this thread's reads during each.

    With ``watch`` (a :class:`Mapped`), ``cached_before[name]`` is its layer's ``cachestat`` when the last
    such call began.
    """

    def __init__(self, real) -> None:
        self._real = real
        self.calls: list[tuple[str, object, int]] = []  # (name, result, bytes this thread submitted during it)
        self.watch: Mapped | None = None
        self.cached_before: dict[str, tuple[int, int] | None] = {}

    def __getattr__(self, name):
        real = getattr(self._real, name)
        if name not in ("read_ahead", "populate_read", "touch_pages", "advise_willneed", "advise_pageout"):
            return real

        def spy(*args, **kwargs):
            if self.watch is not None:
                self.cached_before[name] = self.watch.cachestat()
            before = _thread_read_bytes() if os.path.exists("/proc/thread-self/io") else 0
            out = real(*args, **kwargs)
            after = _thread_read_bytes() if os.path.exists("/proc/thread-self/io") else 0
            self.calls.append((name, out, after - before))
            return out

        return spy

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def spy(monkeypatch):
    s = SpyCore(_core)
    monkeypatch.setattr(pages, "_core", s)
    return s


# -- the probe -------------------------------------------------------------------------------


def test_the_probe_measures_this_machine_and_leaves_the_file_cold(tmp_file_dir, caplog):
    m = Mapped(tmp_file_dir / "probe.bin", prev=0, layer=8 * MIB, nxt=0)
    try:
        kernel.forget_measurements()
        caps = kernel_caps(m.fd)
        logging.getLogger("mapoffload").info("kernel caps here: %s -> %s", caps.describe(), caps.advice())
        print(f"\nkernel caps here: {caps.describe()}\n  -> {caps.advice()}")
        assert caps.release == os.uname().release
        assert caps.how.startswith("measured: one fault read "), caps.how
        # The window it read is dropped again: the file's cache is as it was found.
        assert m.resident() == (0, 0, 0)
        # Once per device: asked again, it does not read the file again.
        assert kernel_caps(m.fd).how == caps.how
        assert m.resident() == (0, 0, 0)
        # The madvise probe agrees with the kernel's own answer on a real mapping.
        err, _ = _core.populate_read(m.spans)
        assert (err == 0) == caps.populate_read
    finally:
        m.close()


def test_a_warm_file_cannot_be_measured_and_is_inferred(tmp_file_dir):
    m = Mapped(tmp_file_dir / "warm.bin", prev=0, layer=4 * MIB, nxt=0)
    try:
        assert _core.populate_read(m.spans)[0] == 0  # every window warm
        kernel.forget_measurements()
        caps = kernel_caps(m.fd)
        assert caps.how.startswith("inferred: kernel "), caps.how
        assert "no cold 2 MiB window" in caps.how
    finally:
        m.close()
        kernel.forget_measurements()


def test_the_worker_logs_the_advice_it_chose_once(layer_file, caplog):
    _log._logged.clear()  # log_once: once per process
    with caplog.at_level(logging.INFO, logger="mapoffload"):
        for _ in range(2):
            w = PageWorker("no-large-folios")
            w.advise(layer_file.spans, layer_file.extents)
            w.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("page-cache advice:")]
    assert len(lines) == 1, lines
    assert "read ahead whole in large I/Os" in lines[0] and "given: no-large-folios" in lines[0], lines[0]


# -- the override ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("", {}),
    ("  ", {}),
    ("no-large-folios", {"large_folios": False}),
    ("No-Large-Folios, pageout", {"large_folios": False, "pageout": True}),
    ("no-populate-read no-pageout,no-cold", {"populate_read": False, "pageout": False, "cold": False}),
    ("large-folios,large-folios", {"large_folios": True}),
])
def test_overrides_parse(text, want):
    assert parse_overrides(text) == want


@pytest.mark.parametrize("text", ["bogus", "no-large-folio", "large-folios,no-large-folios", "no-", "hugepage"])
def test_a_bad_override_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(ENV_KERNEL_CAPS, text)
    with pytest.raises(EnvSettingError) as info:
        PageWorker()
    assert info.value.name == ENV_KERNEL_CAPS and info.value.value == text
    assert ENV_KERNEL_CAPS in str(info.value) and "large-folios" in str(info.value)
    with pytest.raises(ValueError, match="kernel_caps="):
        PageWorker(text)  # the parameter is checked the same way
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="kernel_caps="):
        LayerwiseOffloadManager(model, "blocks", device="cpu", kernel_caps=text)


def test_a_bad_kernel_caps_type_is_refused():
    with pytest.raises(TypeError, match="kernel_caps"):
        PageWorker(3)  # type: ignore[arg-type]


def test_the_parameter_replaces_the_variable(monkeypatch, layer_file):
    monkeypatch.setenv(ENV_KERNEL_CAPS, "no-large-folios,no-pageout")
    from_env = PageWorker().caps(layer_file.extents)
    assert not from_env.large_folios and not from_env.pageout
    given = PageWorker("large-folios").caps(layer_file.extents)
    assert given.large_folios and given.pageout == kernel.advice_supported()["pageout"]
    whole = KernelCaps(release="5.15.0", large_folios=False, populate_read=False, pageout=False, cold=False)
    assert PageWorker(whole).caps(layer_file.extents) is whole


# -- each capability selects its path ------------------------------------------------------------


def test_with_window_faults_a_layer_is_hugepage_random_and_populated(layer_file, spy):
    w = PageWorker("large-folios")
    caps = w.advise(layer_file.spans, layer_file.extents)
    flags = _vm_flags(layer_file.addr + PREV)
    assert {"hg", "rr"} <= flags, flags
    assert pages.read_in(layer_file.spans, "layer", None, caps) == 0
    assert spy.names() == ["populate_read"]
    _skip_if_short_of_memory(layer_file)
    assert layer_file.read_in(neighbours=False), layer_file.cached()  # what reclaim took back was read: see the module


@needs_io_accounting
def test_without_window_faults_a_64_mib_layer_is_read_in_few_large_reads_and_nothing_else(layer_file, spy):
    spy.watch = layer_file
    w = PageWorker("no-large-folios")
    caps = w.advise(layer_file.spans, layer_file.extents)
    flags = _vm_flags(layer_file.addr + PREV)
    assert "rr" in flags and "hg" not in flags, flags  # this kernel now reads 4 KiB per fault, as 5.15 does
    calls = pages.read_in(layer_file.spans, "layer", None, caps)
    assert spy.names() == ["read_ahead", "populate_read"], spy.calls
    _skip_if_short_of_memory(layer_file)
    (_, ahead_calls, ahead_bytes), (_, populated, populate_bytes) = spy.calls
    print(f"\n64 MiB layer, no window faults: {ahead_calls} MADV_WILLNEED calls submitted {ahead_bytes} bytes; "
          f"populate submitted {populate_bytes}")
    assert calls == ahead_calls
    # Few, large requests: at least 128 KiB each (the kernel's smallest usual
    # readahead cap; 8 MiB on this machine's disk), where faults would be 16,384.
    assert 1 <= ahead_calls <= LAYER // (128 << 10), ahead_calls
    # Every byte of the layer was asked for by the read-ahead, and nothing much
    # beyond it (file system metadata at most) ...
    assert LAYER <= ahead_bytes <= LAYER + MIB, ahead_bytes
    # ... so populating only mapped pages already asked for. It read nothing
    # but what reclaim took back meanwhile (see the module): when it began,
    # every page of the layer was cached (or its read in flight) or had been
    # taken back - none was left to its faults.
    assert populated == (0, 0)
    before = spy.cached_before["populate_read"]
    if before is None:  # no cachestat: nothing taken back can be told apart
        assert populate_bytes == 0
    else:
        assert sum(before) == LAYER // PAGE, (before, populate_bytes)
    # All of the layer read in; nothing of the neighbours is resident, or was read and taken back.
    assert layer_file.read_in(), (layer_file.resident(), layer_file.cached())


@needs_io_accounting
def test_without_populate_read_the_pages_are_touched(layer_file, spy):
    spy.watch = layer_file
    w = PageWorker("no-large-folios,no-populate-read")
    caps = w.advise(layer_file.spans, layer_file.extents)
    pages.read_in(layer_file.spans, "layer", None, caps)
    assert spy.names() == ["read_ahead", "touch_pages"], spy.calls
    assert spy.calls[1][1] == (0, 0)
    _skip_if_short_of_memory(layer_file)
    # The touches read nothing themselves: every page was read ahead before
    # them (or read and taken back by reclaim, which they read again: see the module).
    before = spy.cached_before["touch_pages"]
    if before is None:
        assert spy.calls[1][2] == 0
    else:
        assert sum(before) == LAYER // PAGE, (before, spy.calls)
    assert layer_file.read_in(), (layer_file.resident(), layer_file.cached())


def test_without_populate_read_a_truncated_file_is_an_exception_not_a_sigbus(tmp_file_dir):
    m = Mapped(tmp_file_dir / "short.bin", prev=PAGE, layer=4 * MIB, nxt=PAGE)
    try:
        caps = PageWorker("no-populate-read").advise(m.spans, m.extents)
        os.truncate(m.path, PAGE + MIB)
        with pytest.raises(_core.MappingFaultError) as info:
            pages.read_in(m.spans, "layer 3", None, caps)
        assert info.value.errno == errno.EIO and "layer 3" in str(info.value)
    finally:
        m.close()


def test_without_pageout_a_let_go_is_fadvise_only(layer_file, spy):
    w = PageWorker("no-pageout")
    caps = w.advise(layer_file.spans, layer_file.extents)
    # Cached but not mapped here: POSIX_FADV_DONTNEED takes it all. (Read
    # ahead into small folios, waiting for the reads: a plain read() on this
    # kernel makes large folios across the layer's ends, which a drop of the
    # layer's range cannot split.)
    _core.read_ahead(layer_file.spans)
    layer_file.wait_for_reads()
    _skip_if_short_of_memory(layer_file)
    # Cached, but for what reclaim took back (see the module).
    assert layer_file.read_in(neighbours=False), layer_file.cached()
    assert pages.let_go(layer_file.spans, layer_file.extents, caps) == (DROPPED, 0)
    # Mapped by this process: fadvise alone cannot drop it; this process's
    # clean pages are unmapped first (unmap_file_pages), then dropped - all
    # but a large folio at an end that also holds bytes outside the layer.
    pages.read_in(layer_file.spans, "layer", None, caps)
    how, left = pages.let_go(layer_file.spans, layer_file.extents, caps)
    assert left <= 2 * (2 << 20), (how, left)
    assert "advise_pageout" not in spy.names()
    # With MADV_PAGEOUT (this kernel has it) the mapped layer goes.
    if kernel.advice_supported()["pageout"]:
        how, left = pages.let_go(layer_file.spans, layer_file.extents, kernel_caps(layer_file.fd))
        assert left <= 2 * (2 << 20), (how, left)  # at most a large folio at each end, shared with neighbours


# -- the manager ---------------------------------------------------------------------------------


@pytest.mark.parametrize("twin", [False, True], ids=["in-place", "twin"])
def test_the_manager_reads_ahead_by_capability(ckpt, twin):
    path, x, want = ckpt
    reads = {}
    for caps in ("large-folios", "no-large-folios"):
        model = mapped(path)
        layer = model.blocks[0].weight.nbytes + model.blocks[0].bias.nbytes
        mgr = LayerwiseOffloadManager(model, "blocks", device="cpu", cpu_twin=twin, host_store="mapped",
                                      reads="mapping",
                                      page_cache_bytes=6 * layer + PAGE, kernel_caps=caps)
        assert mgr.parts.pages.worker.caps().large_folios == (caps == "large-folios")
        mgr.register_forward_hooks()
        drop_page_cache(path)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        drain(mgr)
        flags = _vm_flags(dict(mgr.iter_cpu_weights())[f"blocks.{LAYERS - 1}.weight"].data_ptr())
        assert ("hg" in flags) == (caps == "large-folios"), flags
        assert "rr" in flags
        reads[caps] = mgr.parts.pages.worker.read_ahead_calls
        streamed = mgr.residency.streamed
        counts = mgr.parts.pages.worker.let_go_counts
        assert streamed and sum(counts.values()) >= len(streamed), counts
        mgr.close()
        del model, mgr
        gc.collect()  # no mapping of the file left for the next drop to miss
    assert reads["large-folios"] == 0
    # Streamed layers are let go after each forward: the second reads each of
    # them ahead again (the first may find some warm: the weights outside the
    # layers are read with readahead, neighbouring layers' bytes among it).
    assert reads["no-large-folios"] >= len(streamed), reads
