"""One native definition of a tensor's byte extent, used by classification,
residency and the copy-on-write report; extraction that survives hostile items."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mapoffload import MappedRegions, _core, cow_report, resident_bytes
from mapoffload.memory.regions import tensor_extent, tensor_spans

import extent_reference as ref
from child import run_python
from native_mem import MAP_FIXED, PAGE, file_page_then_anonymous_page, mmap_raw, munmap, tensor_at


def test_extent_of_contiguous_column_expanded_and_empty_tensors():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_extent(a) == (a.data_ptr(), 48)
    col = a[:, 1]
    assert tensor_extent(col) == (col.data_ptr(), (1 + 2 * 4) * 4)  # spans its rows
    assert tensor_extent(a.t()) == (a.data_ptr(), 48)  # dense, not contiguous
    huge = torch.zeros(1).expand(2**40)
    assert tensor_extent(huge) == (huge.data_ptr(), 4)  # one element per stride-0 dim
    both = torch.zeros(3, 1, dtype=torch.float64).expand(3, 1000)
    assert tensor_extent(both) == (both.data_ptr(), 3 * 8)
    assert tensor_extent(torch.empty(0)) == (0, 0)
    assert tensor_extent(a[:, 1:1]) == (0, 0)
    assert tensor_extent(torch.empty(3, device="meta")) == (0, 0)
    scalar = torch.tensor(7, dtype=torch.int16)
    assert tensor_extent(scalar) == (scalar.data_ptr(), 2)
    spans = tensor_spans([a, col, huge, torch.empty(0)])
    assert spans.sizes == [48, 36, 4, 0]
    assert spans.addrs == [a.data_ptr(), col.data_ptr(), huge.data_ptr(), 0]


def test_extent_rejects_non_tensors_with_the_index():
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        tensor_extent([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="item 1 is int"):
        tensor_spans([torch.zeros(1), 3])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_extent_matches_the_reference_on_random_strided_views(data):
    dtype = data.draw(st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.float64]))
    base = torch.zeros(4096, dtype=dtype)
    ndim = data.draw(st.integers(0, 4))
    shape = data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim))
    stride = data.draw(st.lists(st.integers(0, 40), min_size=ndim, max_size=ndim))
    offset = data.draw(st.integers(0, 64))
    view = base.as_strided(shape, stride, offset)
    assert tensor_extent(view) == ref.extent(view)
    assert tensor_spans([view]).sizes == [ref.extent(view)[1]]
    # Every element the view can read lies inside its extent.
    if view.numel():
        addr, nbytes = tensor_extent(view)
        offsets = [sum(i * s for i, s in zip(idx, stride)) for idx in _indices(shape)]
        item = view.element_size()
        assert base.data_ptr() + (offset + max(offsets)) * item + item <= addr + nbytes
        assert addr == base.data_ptr() + offset * item


def _indices(shape):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (i, *rest)


def test_column_view_crossing_from_a_file_page_into_anonymous_memory(tmp_path):
    with file_page_then_anonymous_page(tmp_path) as base:
        rows = tensor_at(base, 2 * PAGE).view(2, PAGE)
        col = rows[:, 0]  # two bytes, one in each page: its extent crosses the boundary
        regions = MappedRegions()
        assert regions.holds(rows[0]) and regions.classify([rows[0, :8]]) == [True]
        assert not regions.holds(col)
        assert regions.classify([col]) == [False]
        assert regions.span_classes([col]) == ["mixed"]
        assert regions.mapped_bytes([col, rows[0]]) == PAGE


def test_cow_report_sees_every_mapping_a_column_view_reaches(tmp_path):
    paths = [tmp_path / "one.bin", tmp_path / "two.bin"]
    for p in paths:
        p.write_bytes(b"\1" * PAGE)
    base = mmap_raw(2 * PAGE, 0,  # PROT_NONE
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for k, p in enumerate(paths):
            fd = os.open(p, os.O_RDONLY)
            try:
                mmap_raw(PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | MAP_FIXED, fd, 0, addr=base + k * PAGE)
            finally:
                os.close(fd)
        col = tensor_at(base, 2 * PAGE).view(2, PAGE)[:, 0]
        report = cow_report([col])
        assert sorted(m.path for m in report.mappings) == sorted(str(p) for p in paths)
    finally:
        munmap(base, 2 * PAGE)


def test_resident_bytes_counts_the_extent():
    rows = torch.ones(1000, 1024)  # written: every page resident
    col = rows[:, 0]
    assert resident_bytes([col]) == [(1 + 999 * 1024) * 4]
    assert resident_bytes([rows[0]]) == [1024 * 4]


def test_resident_bytes_of_a_stride0_view_is_one_element():
    # Before: numel * itemsize = 4 TiB walked page by page with the GIL released.
    proc = run_python(
        """
        import torch
        from mapoffload import resident_bytes, MappedRegions
        huge = torch.zeros(1).expand(2**40)
        assert resident_bytes([huge]) == [4], resident_bytes([huge])
        assert MappedRegions().span_classes([huge]) == ["anonymous"]
        print("ok")
        """,
        timeout=60,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_classify_survives_items_that_mutate_the_list():
    # Before: the borrowed items of PySequence_Fast were freed under the loop (SIGSEGV).
    proc = run_python(
        """
        import torch
        from mapoffload import MappedRegions, resident_bytes, tensor_spans

        victims = []

        class Evil(torch.Tensor):
            def data_ptr(self):
                victims.clear()  # frees the other items
                victims.extend([None] * 100)  # reallocates the item array
                return super().data_ptr()

        for fn in (MappedRegions().classify, tensor_spans, resident_bytes):
            for _ in range(3):
                victims[:] = [torch.zeros(64).as_subclass(Evil) for _ in range(50)]
                out = fn(victims)
                assert len(out) == 50, (fn, len(out))
        print("ok")
        """,
        timeout=120,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_residency_of_a_span_across_terabytes_of_unmapped_space():
    # Before: mincore failed (ENOMEM) on every chunk and the fallback asked page
    # by page: 2**28 system calls for this span, with the GIL released.
    proc = run_python(
        """
        import ctypes, mmap, time
        from mapoffload import _core
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        PAGE = mmap.PAGESIZE
        MAP_FIXED_NOREPLACE = 0x100000
        base = 0x200000000000  # 32 TiB: far below where the kernel places new mappings
        mid = base + 2**39
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
        p = libc.mmap(mid, 4 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if p != mid:
            print("skip: cannot place a mapping at", hex(mid), ctypes.get_errno())
            raise SystemExit(0)
        ctypes.memset(mid, 1, 2 * PAGE)  # two of the four pages resident
        spans = _core.SpanArray([base, mid - 2**38, mid + PAGE + 10, mid + 4 * PAGE],
                                [2**40, 2**38 + PAGE + 100, 2**40, 2**40])
        t0 = time.monotonic()
        got = _core.resident_bytes(spans)
        took = time.monotonic() - t0
        assert got == [2 * PAGE, PAGE + 100, PAGE - 10, 0], got
        assert took < 10, took
        print("ok", took)
        """,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(("ok", "skip")), (proc.returncode, proc.stderr[-2000:])
    if proc.stdout.startswith("skip"):
        pytest.skip(proc.stdout.strip())


def test_residency_with_a_stale_or_missing_maps_snapshot(tmp_path):
    base = mmap_raw(3 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        ctypes.memset(base, 1, 3 * PAGE)
        munmap(base + PAGE, PAGE)  # a hole in the middle
        spans = _core.SpanArray([base, base + 2 * PAGE], [3 * PAGE, PAGE])
        assert _core.resident_bytes(spans) == [2 * PAGE, PAGE]
        # A snapshot that still shows the hole as mapped: re-read a bounded
        # number of times, then the chunk counts as not resident; it ends.
        stale = tmp_path / "maps"
        stale.write_text(f"{base:x}-{base + 3 * PAGE:x} rw-p 00000000 00:00 0\n")
        assert _core.resident_bytes(spans, maps_path=str(stale)) == [0, PAGE]
        # No snapshot at all: only what lies before the chunk with the hole.
        assert _core.resident_bytes(spans, maps_path=str(tmp_path / "none")) == [0, PAGE]
    finally:
        munmap(base, PAGE)
        munmap(base + 2 * PAGE, PAGE)


# --- the fast path: torch's C accessors called directly, lists read in place ---


class _Shifted(torch.Tensor):
    """Overrides data_ptr in Python: its own answer is the one extracted."""

    def data_ptr(self):
        return super().data_ptr() + 4


class _Plain(torch.Tensor):
    """A subclass without overrides (a Python __torch_function__ runs)."""


def _zoo():
    """One of each kind of item, many times, in a fixed shuffled order."""
    import random

    rows = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    makers = [
        lambda: torch.zeros(5),                                   # contiguous
        lambda: rows[:, 1],                                       # column: not contiguous, extent > nbytes
        lambda: rows.t(),                                         # dense, not contiguous: extent == nbytes
        lambda: torch.zeros(1).expand(1000),                      # stride 0: extent < nbytes
        lambda: torch.zeros(3, 1, dtype=torch.float64).expand(3, 7),
        lambda: rows[::2, ::3],                                   # gaps in both dimensions
        lambda: torch.tensor(3, dtype=torch.int16),               # 0-d
        lambda: torch.empty(0),                                   # empty
        lambda: rows[:, 1:1],                                     # empty view with a real data_ptr
        lambda: torch.empty(4, device="meta"),
        lambda: torch.nn.Parameter(torch.ones(3), requires_grad=False),
        lambda: torch.ones(6).as_subclass(_Shifted),
        lambda: rows[:, 2].as_subclass(_Shifted),                 # override and strided
        lambda: torch.ones(6).as_subclass(_Plain),
        lambda: torch.zeros(3).to_sparse(),                       # no storage
    ]
    rng = random.Random(7)
    return [makers[rng.randrange(len(makers))]() for _ in range(400)], rows


def _expected(t):
    # The reference, through the item's own accessors (an override counts).
    if t.layout != torch.strided:
        return (0, 0)  # sparse: no storage, no host bytes
    return ref.extent(t)


def test_fast_path_matches_the_reference_on_every_kind_of_item():
    items, rows = _zoo()
    # A column view reads as not contiguous and its extent is not numel *
    # itemsize: a fast path that trusted nbytes would be caught here.
    col = rows[:, 1]
    assert not col.is_contiguous() and ref.extent(col)[1] != col.nbytes
    expected = [_expected(t) for t in items]
    assert len(set(expected)) > 50
    for seq in (items, tuple(items), iter(items)):
        spans = tensor_spans(seq)  # type: ignore[arg-type]
        assert list(zip(spans.addrs, spans.sizes)) == expected
    spans = tensor_spans(items[::-1])
    assert list(zip(spans.addrs, spans.sizes)) == expected[::-1]
    for check_device in (True, False):
        spans = _core.extract_spans(items, torch.Tensor, check_device)
        assert list(zip(spans.addrs, spans.sizes)) == expected
    assert [tensor_extent(t) for t in items] == expected


def test_overridden_data_ptr_is_the_answer():
    t = torch.ones(6).as_subclass(_Shifted)
    plain = torch.ones(6)
    spans = tensor_spans([plain] * 20 + [t] + [plain] * 20)
    assert spans.addrs[20] == t.data_ptr() == torch.Tensor.data_ptr(t) + 4
    assert spans.addrs[:20] == [plain.data_ptr()] * 20 == spans.addrs[21:]
    assert tensor_extent(t) == (t.data_ptr(), 24)


def test_a_non_tensor_after_many_tensors_names_its_index():
    # A non-tensor after tensors read through the fast path is a TypeError
    # naming it, never read as a tensor.
    for bad in (3, None, "x", object(), 2**80, [1, 2], torch.float32):
        items = [torch.zeros(2) for _ in range(30)]
        items.insert(17, bad)
        with pytest.raises(TypeError, match=r"item 17 is \S+, not a torch.Tensor") as info:
            tensor_spans(items)
        assert type(bad).__name__ in str(info.value)
        with pytest.raises(TypeError, match="item 17"):
            MappedRegions().classify(items)


def test_a_list_read_in_place_is_still_read_as_it_was_when_the_call_began():
    proc = run_python(
        """
        import torch
        from torch.overrides import TorchFunctionMode
        from mapoffload import MappedRegions, tensor_spans

        victims = []

        class Evil(torch.Tensor):
            def data_ptr(self):
                victims.clear()  # frees the items not read yet
                victims.extend([None] * 7)
                return super().data_ptr()

        class Sneaky(torch.Tensor):
            # torch's own C accessors, but a Python __torch_function__ that
            # torch calls from inside them.
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                victims.clear()
                victims.extend([None] * 7)
                return super().__torch_function__(func, types, args, kwargs or {})

        def fresh(evil_at, kind=Evil, params=False):
            items = [torch.full((k % 5 + 1,), 1.0) for k in range(200)]
            if params:  # torch.nn.Parameter: read in place as plain tensors are
                items = [torch.nn.Parameter(t, requires_grad=k % 2 == 0) for k, t in enumerate(items)]
            if evil_at is not None:
                items[evil_at] = torch.zeros(3).as_subclass(kind)
            want = [t.nbytes for t in items]  # (Sneaky's nbytes mutates victims too)
            victims[:] = items
            return want

        # An item that runs Python code after 100 read in place: the rest is
        # snapshotted before it is asked anything.
        for kind in (Evil, Sneaky):
            for params in (False, True):
                for evil_at in (0, 1, 100, 199, None):
                    want = fresh(evil_at, kind, params)
                    assert tensor_spans(victims).sizes == want, (kind, params, evil_at)
                    fresh(evil_at, kind, params)
                    assert len(MappedRegions().classify(victims)) == 200

        # A torch function mode runs Python code for exact tensors too: read as
        # a snapshot from the start.
        class Mutate(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                victims.clear()
                victims.extend([None] * 7)
                return func(*args, **(kwargs or {}))

        want = fresh(None)
        with Mutate():
            got = tensor_spans(victims).sizes
        assert got == want, got[:5]
        print("ok")
        """,
        timeout=120,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize(
    "mutate",
    ["v.clear(); v.extend([None] * 3)", "v[40:] = [torch.ones(2) for _ in range(20)]"],
    ids=["shrunk", "replaced"],
)
def test_python_code_run_where_none_was_expected_cannot_free_items_under_the_read(mutate):
    # A warning torch raises from data_ptr() (once a process) runs the
    # warnings hook, Python, in the middle of an exact tensor's read. The list
    # changed: an error, never a read past its end, of a freed item, or of an
    # item the list did not hold when the call began.
    if not hasattr(torch._C, "_set_warn_deprecated_on_mutable_data_ptr"):
        pytest.skip("this torch cannot make data_ptr() warn")
    proc = run_python(
        f"""
        import warnings
        import torch
        from mapoffload import tensor_spans

        warnings.simplefilter("always")
        victims = [torch.zeros(4) for _ in range(60)]
        torch._C._set_warn_deprecated_on_mutable_data_ptr(victims[30])
        ran = []

        def hook(*args, **kwargs):
            v = victims
            {mutate}
            ran.append(True)

        warnings.showwarning = hook
        try:
            tensor_spans(victims)
        except RuntimeError as exc:
            assert "changed while it was read" in str(exc), exc
        else:
            raise AssertionError("read a list that changed under the read")
        assert ran
        print("ok")
        """,
        timeout=120,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_tensor_bytes_is_a_dense_copy_and_the_extent_is_where_the_bytes_lie():
    from mapoffload.memory.regions import tensor_bytes

    base = torch.zeros(4, 6)
    col = base[:, 1]
    wide = torch.zeros(1).expand(1000)
    meta = torch.empty(3, 5, dtype=torch.float16, device="meta")
    assert tensor_bytes(base) == tensor_extent(base)[1] == 96  # contiguous: the two agree
    assert tensor_bytes(col) == 16 and tensor_extent(col)[1] == (3 * 6 + 1) * 4  # a column spans its rows
    assert tensor_bytes(wide) == 4000 and tensor_extent(wide)[1] == 4  # expanded: one element
    assert tensor_bytes(meta) == 30 and tensor_extent(meta) == (0, 0)  # meta: a copy's size, no bytes anywhere
    assert all(tensor_bytes(t) == t.nbytes for t in (base, col, wide, meta))  # torch's nbytes
