"""Replicas: two processes mapping the same layer. ``MADV_PAGEOUT`` skips a
page another process maps, so a lone let-go cannot drop it; each process
unmaps its own clean pages when it lets go, and whichever lets go last drops
them from the page cache. A page written in place (anonymous) is never
dropped."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from mapoffload import _core
from mapoffload.pagecache.mapped_file import MappedFiles
from mapoffload.pagecache.pages import KEPT, file_extents, layer_spans, let_go

MIB = 1 << 20
SIZE = 8 * MIB

CHILD = textwrap.dedent(
    """
    import ctypes, mmap, sys
    from mapoffload import _core
    from mapoffload.pagecache.mapped_file import MappedFiles
    from mapoffload.pagecache.pages import file_extents, layer_spans, let_go
    path = sys.argv[1]
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    spans = layer_spans([(addr, len(m))])
    _core.populate_read(spans)
    print("ready", flush=True)
    sys.stdin.readline()
    how, left = let_go(spans, file_extents(spans, MappedFiles()))
    print(how, left, sum(_core.resident_bytes(spans)), flush=True)
    """
)


def _map(path):
    import ctypes

    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return f, m, layer_spans([(addr, len(m))])


@pytest.fixture
def layer_file(tmp_path_factory):
    folder = "/var/tmp" if os.path.isdir("/var/tmp") else str(tmp_path_factory.mktemp("replica"))
    path = os.path.join(folder, f"mapoffload-replica-{os.getpid()}.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(SIZE))
        f.flush()
        os.fsync(f.fileno())  # clean pages: a dirty page cannot be dropped
    yield path
    os.unlink(path)


def test_the_last_replica_to_let_go_drops_the_shared_pages(layer_file):
    f, m, spans = _map(layer_file)
    _core.populate_read(spans)
    if sum(_core.resident_bytes(spans)) < SIZE:
        pytest.skip("the pages did not stay resident (tmpfs or memory pressure)")
    child = subprocess.Popen([sys.executable, "-c", CHILD, layer_file], stdin=subprocess.PIPE,
                             cwd=os.path.dirname(layer_file),  # not the source folder: it shadows the package
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        files = MappedFiles()
        how, left = let_go(spans, file_extents(spans, files))
        # The replica maps every page: this process can only let its own mappings go.
        assert how == KEPT and left > SIZE // 2
        child.stdin.write("go\n")
        child.stdin.flush()
        how2, left2, resident = child.stdout.readline().split()
        assert child.wait(timeout=60) == 0
        # The replica let go last: nobody maps the pages, they are dropped.
        assert how2 in ("pageout", "drained", "unmapped") and int(left2) == 0, (how2, left2)
        assert sum(_core.resident_bytes(spans)) == 0
        files.close()
    finally:
        if child.poll() is None:
            child.kill()
        m.close()
        f.close()


def test_a_page_written_in_place_is_never_unmapped(layer_file):
    f, m, spans = _map(layer_file)
    try:
        _core.populate_read(spans)
        m[0:8] = b"written!"
        advised = _core.unmap_file_pages(spans)
        assert 0 < advised <= SIZE - os.sysconf("SC_PAGE_SIZE")
        assert m[0:8] == b"written!"  # the private copy is kept
        with open(layer_file, "rb") as g:
            assert m[4096:8192] == g.read(8192)[4096:]  # the rest maps the file again
    finally:
        m.close()
        f.close()
