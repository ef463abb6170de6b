"""The page worker's two threads (issue 43): a let-go runs beside the reads queued before it, yet the
order that bounds the page cache holds - a read starts only after every let-go asked before it, and a
let-go of bytes still being read waits for that read.

The native calls are replaced by ones that record and block, so the order is observed, not timed.
"""

import threading

import pytest

from mapoffload._native import _core
from mapoffload.pagecache import pages
from mapoffload.pagecache.pages import PageWorker

MIB = 1 << 20


@pytest.fixture
def calls(monkeypatch):
    """Each read and let-go records ``(kind, first address)`` when it starts and waits for its gate."""
    log: list[tuple[str, int, str]] = []
    gates: dict[int, threading.Event] = {}

    def gate(addr):
        return gates.setdefault(addr, threading.Event())

    def read_in(spans, what="weights", edges=None, caps=None):
        log.append(("read", spans.addrs[0], "start"))
        assert gate(spans.addrs[0]).wait(10), "a read was never let through"
        log.append(("read", spans.addrs[0], "end"))
        return 0

    def let_go(spans, extents=(), caps=None):
        log.append(("let go", spans.addrs[0], "start"))
        assert gate(spans.addrs[0]).wait(10), "a let-go was never let through"
        log.append(("let go", spans.addrs[0], "end"))
        return pages.PAGEOUT, 0

    monkeypatch.setattr(pages, "read_in", read_in)
    monkeypatch.setattr(pages, "let_go", let_go)
    return log, gate


def _span(mib: int) -> _core.SpanArray:
    return _core.SpanArray([mib * MIB], [MIB])


def _wait_for(log, entry):
    for _ in range(1000):
        if entry in log:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{entry} never happened: {log}")


def test_a_let_go_runs_beside_a_read_queued_before_it(calls):
    log, gate = calls
    w = PageWorker("large-folios")
    try:
        reading = w.read_in(_span(10))
        _wait_for(log, ("read", 10 * MIB, "start"))
        gate(20 * MIB).set()
        w.let_go(_span(20)).result(timeout=10)  # another part's bytes: done while the read still runs
        assert not reading.done()
        gate(10 * MIB).set()
        reading.result(timeout=10)
    finally:
        for e in (10, 20):
            gate(e * MIB).set()
        w.close()


def _held_back(calls, first, second) -> None:
    """``first()`` asked and begun, then ``second()``: ``second`` does not begin while ``first`` is held, and
    begins only after it ended. Each is ``(kind, address, ask)``: ``ask(worker)`` returns its future."""
    log, gate = calls
    w = PageWorker("large-folios")
    try:
        one = first[2](w)
        _wait_for(log, (first[0], first[1], "start"))
        two = second[2](w)
        threading.Event().wait(0.2)
        assert (second[0], second[1], "start") not in log
        gate(second[1]).set()
        gate(first[1]).set()
        one.result(timeout=10)
        two.result(timeout=10)
        assert log.index((first[0], first[1], "end")) < log.index((second[0], second[1], "start"))
    finally:
        gate(first[1]).set()
        gate(second[1]).set()
        w.close()


def test_a_read_starts_only_after_the_let_gos_asked_before_it(calls):
    """Another part's bytes: the page cache would hold both."""
    _held_back(calls, ("let go", 20 * MIB, lambda w: w.let_go(_span(20))),
               ("read", 30 * MIB, lambda w: w.read_in(_span(30))))


def test_a_let_go_of_bytes_being_read_waits_for_the_read(calls):
    """Inside the read's bytes: let go before they are in, they would stay."""
    _held_back(calls, ("read", 10 * MIB, lambda w: w.read_in(_core.SpanArray([10 * MIB], [4 * MIB]))),
               ("let go", 12 * MIB, lambda w: w.let_go(_core.SpanArray([12 * MIB], [MIB]))))


def test_a_failed_read_does_not_hold_the_let_go_back(monkeypatch):
    def read_in(spans, what="weights", edges=None, caps=None):
        raise OSError("the file went away")

    went: list[int] = []
    monkeypatch.setattr(pages, "read_in", read_in)
    monkeypatch.setattr(pages, "let_go", lambda spans, extents=(), caps=None: (went.append(1), (pages.PAGEOUT, 0))[1])
    w = PageWorker("large-folios")
    try:
        reading = w.read_in(_span(10))
        w.let_go(_span(10)).result(timeout=10)
        with pytest.raises(OSError, match="went away"):
            reading.result(timeout=10)
        assert went == [1]
    finally:
        w.close()


def test_drain_waits_for_both_threads(calls):
    log, gate = calls
    w = PageWorker("large-folios")
    try:
        w.read_in(_span(10))
        w.let_go(_span(20))
        drained = threading.Thread(target=w.drain)
        drained.start()
        drained.join(0.2)
        assert drained.is_alive()
        gate(10 * MIB).set()
        drained.join(0.2)
        assert drained.is_alive()  # the let-go is still held
        gate(20 * MIB).set()
        drained.join(10)
        assert not drained.is_alive()
        assert {e[:2] for e in log if e[2] == "end"} == {("read", 10 * MIB), ("let go", 20 * MIB)}
    finally:
        for e in (10, 20):
            gate(e * MIB).set()
        w.close()


def test_a_let_go_between_the_spans_of_a_read_does_not_wait_for_it(calls):
    """A read of two spans far apart (an fp8 weight's scales at the file's start, its codes at the end): the
    let-go of another part's bytes between them runs beside it."""
    log, gate = calls
    w = PageWorker("large-folios")
    try:
        reading = w.read_in(_core.SpanArray([10 * MIB, 40 * MIB], [MIB, MIB]))
        _wait_for(log, ("read", 10 * MIB, "start"))
        gate(20 * MIB).set()
        w.let_go(_span(20)).result(timeout=10)
        assert not reading.done()
    finally:
        for e in (10, 20):
            gate(e * MIB).set()
        w.close()


def test_the_read_ahead_calls_are_counted_whole_from_every_thread(monkeypatch):
    """The reader thread and the copier's threads count ``MADV_WILLNEED`` calls into one total: an
    unlocked ``+=`` lost about half of 80,000 counts under a short switch interval."""
    import sys

    monkeypatch.setattr(pages, "before_copy", lambda spans, edges, caps: 1)
    monkeypatch.setattr(pages, "read_in", lambda spans, what, edges, caps: 1)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker = PageWorker()
    monkeypatch.setattr(worker, "caps", lambda extents=(): None)
    n, copiers = 5000, 3
    spans = _core.SpanArray([4096], [4096])

    def copier():
        for _ in range(n):
            worker.before_copy(spans, None)

    try:
        threads = [threading.Thread(target=copier) for _ in range(copiers)]
        reads = [worker.read_in(spans) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in reads:
            r.result()
    finally:
        sys.setswitchinterval(interval)
        worker.close()
    assert worker.read_ahead_calls == n * (copiers + 1)
