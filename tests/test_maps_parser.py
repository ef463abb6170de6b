"""The pure parsers of the native core, on hand-written fixtures and against
the Python reference (property tests)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mapoffload import _core

import maps_reference as ref

FIXTURE = """\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000001000 r--p 00000000 fd:01 1234                       /opt/models/my model (v2).safetensors
7f0000001000-7f0000003000 rw-p 00001000 fd:01 1234                       /opt/models/my model (v2).safetensors
7f0000003000-7f0000004000 r--p 00003000 fd:01 1234                       /opt/models/my model (v2).safetensors
7f0000010000-7f0000011000 rw-p 00000000 fd:01 99                         /tmp/gone.bin (deleted)
7f0000020000-7f0000021000 rw-s 00000000 00:01 5                          /memfd:weights (deleted)
7f0000030000-7f0000031000 rw-s 00000000 00:19 77                         /dev/shm/torch_123_0
7f0000040000-7f0000041000 rw-s 00000000 00:01 6                          /dev/zero (deleted)
7f0000050000-7f0000051000 rw-s 00000000 00:01 7                          /SYSV0000abcd (deleted)
7f0000060000-7f0000061000 rw-p 00000000 00:00 0                          [anon:torch arena]
7f0000070000-7f0000071000 rw-p 00000000 00:00 0 
7f0000080000-7f0000081000 rw-s 00000000 00:2a 12                         /run/user/0/scratch.bin
7f0000090000-7f0000091000 rw-s 00000000 00:05 300                        /dev/nvidia0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00100000-7ffd00102000 r--p 00000000 00:00 0                          [vvar]
7ffd00102000-7ffd00104000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""

MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
24 22 0:25 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
25 22 0:42 / /run/user/0 rw,nosuid - tmpfs tmpfs rw,size=100k
26 22 0:5 / /dev rw,nosuid - devtmpfs udev rw
"""


def test_fixture_fields_and_path_rules():
    t = _core.parse_maps(FIXTURE)
    assert len(t) == 17
    assert t.starts[0] == 0x55D0C0A00000 and t.ends[0] == 0x55D0C0A21000
    assert t.paths[1] == "/opt/models/my model (v2).safetensors"
    assert t.perms[2] == "rw-p" and t.perms[5] == "rw-s"
    assert t.offsets[2] == 0x1000
    assert t.devs[1] == (0xFD, 0x01) and t.inodes[1] == 1234
    assert t.starts[-1] == 0xFFFFFFFFFF600000 and t.ends[-1] == 0xFFFFFFFFFF601000
    assert t.paths[10] == ""
    assert t.classes == [
        "anonymous", "file", "file", "file", "file", "shmem", "shmem", "shmem", "shmem",
        "anonymous", "anonymous",
        "file",  # /run/user/0 is tmpfs, but only the mount table says so
        "special", "anonymous", "special", "special", "special",
    ]


def test_mountinfo_tells_tmpfs_from_disk():
    t = _core.parse_maps(FIXTURE)
    assert _core.parse_mountinfo(MOUNTINFO)[(0, 42)] == "tmpfs"
    t.apply_mountinfo(MOUNTINFO)
    assert t.classes[11] == "shmem"  # tmpfs mounted elsewhere than /dev/shm
    assert t.classes[12] == "special"  # device node on devtmpfs
    assert t.classes[1] == "file" and t.classes[4] == "file"  # ext4, deleted file included


def test_adjacent_vmas_of_one_file_form_one_run():
    t = _core.parse_maps(FIXTURE)
    base = 0x7F0000000000
    assert t.run_ends[1] == base + 0x4000  # three VMAs split by mprotect
    assert t.holds_pointer(base) and t.holds_pointer(base + 0x3FFF)
    assert not t.holds_pointer(base + 0x4000)
    spans = _core.SpanArray([base + 10, base + 0x3000, base + 0x3F00, 0, base], [0x3FF0 - 10, 0x1000, 0x200, 8, 0])
    assert t.holds_spans(spans) == [True, True, False, False, False]
    assert t.span_classes(spans) == ["file", "file", "mixed", "unmapped", "unmapped"]


def test_deleted_file_is_file_and_memfd_is_not():
    t = _core.parse_maps(FIXTURE)
    assert t.holds_pointer(0x7F0000010000)
    assert not t.holds_pointer(0x7F0000020000)
    assert not t.holds_pointer(0)


def test_empty_input():
    assert len(_core.parse_maps("")) == 0
    assert not _core.parse_maps("").holds_pointer(4096)


def test_unsorted_input_is_rejected():
    # The kernel prints VMAs in address order; anything else is not /proc text.
    lines = FIXTURE.splitlines()
    with pytest.raises(ValueError, match=r"line 2: .*not sorted"):
        _core.parse_maps("\n".join(reversed(lines)) + "\n")


@pytest.mark.parametrize(
    "line, lineno",
    [
        ("zz-1000 r--p 00000000 00:00 0", 1),
        ("1000-2000 r--x 00000000 00:00 0", 1),
        ("1000 r--p 00000000 00:00 0", 1),
        ("2000-1000 r--p 00000000 00:00 0", 1),
        ("1000-2000 r--p 00000000 0000 0", 1),
        ("1000-2000 r--p 00000000 00:00 x", 1),
        ("1000-2000 r--p 00000000 00:00", 1),
        ("1000-2000 r--p", 1),
        ("10000000000000000-10000000000000001 r--p 00000000 00:00 0", 1),
        ("5000-5000 r--p 00000000 00:00 0", 1),  # empty VMA
        ("100000000:0 r--p 00000000 00:00 0", 1),
        ("5000-6000 r--p 00000000 100000000:00 7 /f", 1),  # 33-bit major
        ("5000-6000 r--p 00000000 00:1ffffffff 7 /f", 1),  # 33-bit minor
        ("3800-5000 r--p 00000000 00:00 0", 1),  # overlaps 3000-4000
        ("0800-0900 r--p 00000000 00:00 0", 1),  # below the previous start
    ],
)
def test_malformed_line_names_its_number(line, lineno):
    good = "1000-2000 r--p 00000000 00:00 0\n"
    with pytest.raises(ValueError, match=rf"line {lineno + 2}\b"):
        _core.parse_maps(good + good.replace("1000-2000", "3000-4000") + line + "\n")


@pytest.mark.parametrize(
    "line, message",
    [
        ("5000-5000 r--p 00000000 00:00 0", "end address must be above the start"),
        ("5000-4800 r--p 00000000 00:00 0", "end address must be above the start"),
        ("5000-6000 r--p 00000000 100000000:00 7 /f", "device major.*32 bits"),
        ("5000-6000 r--p 00000000 00:100000000 7 /f", "device minor.*32 bits"),
        ("3fff-5000 r--p 00000000 00:00 0", "overlaps the previous mapping"),
        ("2000-2800 r--p 00000000 00:00 0", "not sorted"),
    ],
)
def test_malformed_vmas_say_what_is_wrong(line, message):
    good = "1000-2000 r--p 00000000 00:00 0\n3000-4000 r--p 00000000 00:00 0\n"
    with pytest.raises(ValueError, match=rf"^line 3: {message}"):
        _core.parse_maps(good + line + "\n")
    smaps = good.replace("\n", "\nRss: 4 kB\n") + line + "\n"
    with pytest.raises(ValueError, match=rf"^line 5: {message}"):
        _core.parse_smaps(smaps)


def test_widest_device_numbers_are_kept_apart():
    t = _core.parse_maps("1000-2000 r--p 00000000 ffffffff:ffffffff 7 /a\n2000-3000 r--p 00000000 1:0 7 /a\n")
    assert t.devs == [(0xFFFFFFFF, 0xFFFFFFFF), (1, 0)]
    assert t.run_ends == [0x2000, 0x3000]  # different devices: not one run


def test_mountinfo_device_numbers_must_fit_32_bits():
    with pytest.raises(ValueError, match="line 1: device major.*32 bits"):
        _core.parse_mountinfo("22 1 4294967296:1 / / rw - ext4 /dev/vda1 rw\n")
    with pytest.raises(ValueError, match="line 1: device minor.*32 bits"):
        _core.parse_mountinfo("22 1 1:4294967296 / / rw - ext4 /dev/vda1 rw\n")
    assert _core.parse_mountinfo("22 1 4294967295:4294967295 / / rw - ext4 /dev/vda1 rw\n") == {
        (0xFFFFFFFF, 0xFFFFFFFF): "ext4"
    }


def test_non_utf8_paths_are_fsdecoded():
    raw = b"1000-2000 r--p 00000000 fd:01 5   /m/w\xff.safetensors\n2000-3000 r--p 00000000 fd:01 6 /ok\n"
    t = _core.parse_maps(raw)
    assert t.paths == ["/m/w\udcff.safetensors", "/ok"]
    assert os.fsencode(t.paths[0]) == b"/m/w\xff.safetensors"
    s = _core.parse_smaps(raw.replace(b"\n2000", b"\nAnonymous: 4 kB\n2000"))
    assert s.paths[0] == "/m/w\udcff.safetensors" and s.anonymous == [4096, 0]


def test_malformed_mountinfo_names_its_line():
    with pytest.raises(ValueError, match="line 2"):
        _core.parse_mountinfo(MOUNTINFO.splitlines()[0] + "\nnot a mount line\n")


SMAPS = """\
7f0000000000-7f0000004000 rw-p 00000000 fd:01 1234                       /data/w.safetensors
Size:                 16 kB
Rss:                  12 kB
Anonymous:             4 kB
Private_Dirty:         4 kB
Swap:                  0 kB
VmFlags: rd wr mr mw me ac sd
7f0000010000-7f0000011000 rw-p 00000000 00:00 0
Size:                  4 kB
Rss:                   4 kB
Anonymous:             4 kB
"""


def test_smaps_fields():
    t = _core.parse_smaps(SMAPS)
    assert len(t) == 2
    assert t.rss == [12 * 1024, 4096]
    assert t.anonymous == [4096, 4096]
    assert t.private_dirty == [4096, 0]
    assert t.classes == ["file", "anonymous"]
    assert t.touching(_core.SpanArray([0x7F0000003FFF], [2])) == [0]
    with pytest.raises(ValueError, match="line 1"):
        _core.parse_smaps("Rss: 4 kB\n")


# --- property tests against the Python reference ---------------------------------

PATHS = [
    "", "[heap]", "[stack]", "[anon:x]", "[vdso]", "/a/w.safetensors", "/a/b c.bin (deleted)",
    "/memfd:m (deleted)", "/dev/shm/s", "/SYSV00000001 (deleted)", "/dev/nvidia0", "anon_inode:x",
]


@st.composite
def maps_text(draw):
    n = draw(st.integers(0, 30))
    addr = draw(st.integers(1, 1 << 40)) << 12
    lines = []
    for _ in range(n):
        addr += draw(st.sampled_from([0, 0, 4096, 8192]))
        size = draw(st.integers(1, 4)) * 4096
        path = draw(st.sampled_from(PATHS))
        inode = 0 if path in ("", "[heap]", "[stack]", "[anon:x]", "[vdso]") else draw(st.sampled_from([7, 8]))
        dev = "00:00" if inode == 0 else draw(st.sampled_from(["fd:01", "00:19"]))
        perms = draw(st.sampled_from(["r--p", "rw-p", "r-xp", "rw-s"]))
        pad = " " * draw(st.integers(1, 20))
        lines.append(f"{addr:x}-{addr + size:x} {perms} {0:08x} {dev} {inode}{pad}{path}")
        addr += size
    return "\n".join(lines) + ("\n" if lines else "")


def _line_error(parse, text):
    try:
        parse(text)
    except ValueError as exc:
        return str(exc).split(":")[0]
    return None


@settings(max_examples=100, deadline=None)
@given(maps_text(), st.data())
def test_parser_and_reference_reject_the_same_reordered_text(text, data):
    lines = text.splitlines()
    if len(lines) >= 2:
        i = data.draw(st.integers(0, len(lines) - 2))
        j = data.draw(st.integers(i + 1, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    shuffled = "\n".join(lines) + "\n"
    assert _line_error(_core.parse_maps, shuffled) == _line_error(ref.parse, shuffled)


@settings(max_examples=200, deadline=None)
@given(maps_text(), st.data())
def test_parser_and_classifier_match_reference(text, data):
    native = _core.parse_maps(text)
    vmas = ref.parse(text)
    assert native.starts == [v.start for v in vmas]
    assert native.ends == [v.end for v in vmas]
    assert native.paths == [v.path for v in vmas]
    assert native.classes == [v.cls for v in vmas]
    assert native.devs == [v.dev for v in vmas]
    lo = vmas[0].start - 8192 if vmas else 4096
    hi = vmas[-1].end + 8192 if vmas else 1 << 20
    addrs = data.draw(st.lists(st.integers(max(lo, 0), hi), min_size=1, max_size=20))
    sizes = data.draw(st.lists(st.integers(0, 40000), min_size=len(addrs), max_size=len(addrs)))
    spans = _core.SpanArray(addrs, sizes)
    assert native.holds_spans(spans) == [ref.holds_span(vmas, a, n) for a, n in zip(addrs, sizes)]
    # In address order, as a model's tensors usually come: runs of spans that
    # start in the VMA of the one before (the classifier's remembered VMA).
    ordered = sorted(zip(addrs, sizes))
    assert native.holds_spans(_core.SpanArray([a for a, _ in ordered], [n for _, n in ordered])) == [
        ref.holds_span(vmas, a, n) for a, n in ordered
    ]
    assert native.span_classes(spans) == [ref.span_class(vmas, a, n) for a, n in zip(addrs, sizes)]


def test_smaps_value_beyond_64_bits_of_bytes_is_rejected():
    text = "1000-2000 r--p 00000000 00:00 0\nRss: 18014398509481984 kB\n"  # 2**54 kB = 2**64 bytes
    with pytest.raises(ValueError, match="line 2: .*64 bits"):
        _core.parse_smaps(text)
    assert _core.parse_smaps(text.replace("18014398509481984", "18014398509481983")).rss == [2**64 - 1024]


def test_span_total_bytes_does_not_wrap():
    assert _core.SpanArray([1, 2], [2**64 - 1, 2]).total_bytes == 2**64 + 1
    assert _core.SpanArray([1, 2], [3, 4]).total_bytes == 7


TORN = """\
7f0000000000-7f0000003000 r--p 00000000 fd:01 1234                       /a.safetensors
7f0000001000-7f0000004000 r--p 00001000 fd:01 1234                       /a.safetensors
"""


def test_a_torn_maps_read_is_read_again():
    """/proc/self/maps read while another thread splits and merges VMAs can show a VMA changed
    between two read() calls: lines out of order or overlapping (a thread of test_attack_offload
    raised 'line 10: overlaps the previous mapping'). The snapshot reads the file again rather than
    fail: here a thread splits and merges one mapping (mprotect of its middle page) as fast as it can
    while snapshots of a maps file long enough to take several reads are taken."""
    import ctypes
    import mmap
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    # 3000 one-page mappings, every other one read-only (adjacent mappings alike would merge): a maps
    # text of ~200 KiB, several read() calls of the snapshot's 64 KiB (measured with reads of that
    # size from Python: 46 of 300 such texts were torn).
    keep = [mmap.mmap(-1, page) for _ in range(3000)]
    for m in keep[1::2]:
        view = ctypes.c_char.from_buffer(m)
        libc.mprotect(ctypes.addressof(view), page, mmap.PROT_READ)
        del view
    churn = mmap.mmap(-1, 3 * page)
    view = ctypes.c_char.from_buffer(churn)
    addr = ctypes.addressof(view)
    stop = threading.Event()

    def split_and_merge():
        while not stop.is_set():
            libc.mprotect(addr + page, page, mmap.PROT_READ)  # three VMAs
            libc.mprotect(addr + page, page, mmap.PROT_READ | mmap.PROT_WRITE)  # one again

    t = threading.Thread(target=split_and_merge, daemon=True)
    t.start()
    try:
        for _ in range(300):
            assert len(_core.snapshot()) > 3000
    finally:
        stop.set()
        t.join(5)
        del view, keep


def test_maps_out_of_order_on_every_read_is_refused_by_line(tmp_path):
    path = tmp_path / "maps"
    path.write_text(TORN)
    with pytest.raises(ValueError, match="line 2: overlaps the previous mapping"):
        _core.snapshot(str(path), os.devnull)
