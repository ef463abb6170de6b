"""What the running kernel does with the page-cache advice the manager gives,
found out at run time.

The manager keeps a fault from reading a neighbouring layer back in with
``MADV_RANDOM``. That is cheap only where a fault on a ``MADV_HUGEPAGE``
mapping reads the whole aligned 2 MiB window of the file that holds it
(``do_sync_mmap_readahead``, Linux 5.18+; into large folios where the file
system has them). Before that (Ubuntu 22.04's 5.15, RHEL 9's 5.14) a fault
under ``MADV_RANDOM`` reads its own 4 KiB page and nothing more: reading a
64 MiB layer by faults is 16,384 reads. So this is asked, per device, by
measuring it: one fault on a cold 2 MiB window of the checkpoint file itself
(:func:`measure_window_faults`), then the window is dropped again. A kernel
cannot answer that wrongly the way a version number or a sysfs setting can.

Which ``madvise`` advice exists is asked on a one-page anonymous mapping:
``EINVAL`` means the kernel does not know it (``MADV_COLD``/``MADV_PAGEOUT``
5.4+, ``MADV_POPULATE_READ`` 5.14+).

Tests and users can say what to assume instead (:func:`parse_overrides`):
``MAPOFFLOAD_KERNEL_CAPS="no-large-folios,no-pageout"``, or the manager's
``kernel_caps=`` argument, which takes the same text (or a :class:`KernelCaps`)
and replaces the variable. What is not said is still found out.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import threading

from .._env import EnvSettingError
from .._log import format_bytes, logger
from .._native import _core

__all__ = [
    "ENV_KERNEL_CAPS",
    "FEATURES",
    "KernelCaps",
    "advice_supported",
    "kernel_caps",
    "measure_window_faults",
    "parse_overrides",
]

ENV_KERNEL_CAPS = "MAPOFFLOAD_KERNEL_CAPS"

WINDOW = 2 << 20  # what one fault reads on a MADV_HUGEPAGE mapping, where it reads windows (a PMD folio)
PROBE_CANDIDATES = 16  # windows of a file looked at for a cold one

# Feature -> the KernelCaps field it sets.
FEATURES = {
    "large-folios": "large_folios",
    "populate-read": "populate_read",
    "pageout": "pageout",
    "cold": "cold",
}

# madvise advice numbers (include/uapi/asm-generic/mman-common.h); Python's
# mmap module names only those its build knew.
_ADVICE = {"cold": 20, "pageout": 21, "populate_read": 22}


@dataclasses.dataclass(frozen=True)
class KernelCaps:
    """What the kernel does with the manager's page-cache advice.

    Attributes
    ----------
    release
        ``uname -r``.
    large_folios
        A fault on a ``MADV_HUGEPAGE`` + ``MADV_RANDOM`` file mapping reads
        the whole aligned 2 MiB window that holds it, in one I/O (into a
        large folio where the file system has them). False: it reads its own
        4 KiB page only.
    populate_read, pageout, cold
        ``madvise`` accepts ``MADV_POPULATE_READ`` / ``MADV_PAGEOUT`` /
        ``MADV_COLD``.
    how
        Where each answer came from: ``measured``, ``given``, ``inferred``
        (with the detail), for the log line.
    """

    release: str
    large_folios: bool
    populate_read: bool
    pageout: bool
    cold: bool
    how: str = ""

    def advice(self) -> str:
        """The page-cache path these capabilities select, in words."""
        if self.large_folios:
            read = ("a layer is read by faults in whole 2 MiB windows (MADV_HUGEPAGE + MADV_RANDOM, then "
                    + ("MADV_POPULATE_READ)" if self.populate_read else "a read of a byte per page)"))
        else:
            read = ("a fault under MADV_RANDOM reads 4 KiB: a layer is read ahead whole in large I/Os "
                    "(MADV_WILLNEED over its bytes, as far as the kernel reads per call; no MADV_HUGEPAGE), then "
                    + ("mapped (MADV_POPULATE_READ)" if self.populate_read else "mapped by reading a byte per page"))
        if self.pageout:
            go = "streamed layers are let go with MADV_COLD + MADV_PAGEOUT"
        else:
            go = ("no MADV_PAGEOUT: streamed layers are let go with POSIX_FADV_DONTNEED only, which cannot drop "
                  "pages this process maps (they stay until reclaim takes them)")
        return f"{read}; {go}"

    def describe(self) -> str:
        yes = lambda b: "yes" if b else "no"  # noqa: E731
        return (f"kernel {self.release}: MADV_POPULATE_READ {yes(self.populate_read)}, MADV_PAGEOUT "
                f"{yes(self.pageout)}, MADV_COLD {yes(self.cold)}, 2 MiB window faults "
                f"{yes(self.large_folios)} ({self.how})")


def parse_overrides(text: str, *, variable: str | None = None) -> dict[str, bool]:
    """``"no-large-folios, pageout"`` -> ``{"large_folios": False, "pageout": True}``.

    Tokens are separated by commas or spaces; each is a feature
    (``large-folios``, ``populate-read``, ``pageout``, ``cold``) or the same
    with ``no-`` in front. Blank text says nothing.

    Raises
    ------
    EnvSettingError
        (with ``variable``, the environment variable the text came from), or
        ``ValueError`` otherwise: an unknown token, or a feature both said
        and denied.
    """
    accepted = ("expected features separated by commas, each one of " + ", ".join(FEATURES)
                + ", or the same with 'no-' in front (e.g. 'no-large-folios,no-pageout')")
    out: dict[str, bool] = {}
    for token in filter(None, re.split(r"[,\s]+", text.strip().lower())):
        on = not token.startswith("no-")
        field = FEATURES.get(token if on else token[3:])
        problem = None
        if field is None:
            problem = f"unknown feature {token!r}; {accepted}"
        elif out.get(field, on) != on:
            problem = f"{token!r} contradicts an earlier token; {accepted}"
        if problem:
            if variable is not None:
                raise EnvSettingError(variable, text, problem)
            raise ValueError(f"kernel_caps={text!r} is not accepted: {problem}")
        out[field] = on
    return out


def overrides(given: str | KernelCaps | None = None) -> dict[str, bool]:
    """What to assume: ``given`` (text or a whole :class:`KernelCaps`) when not None, else the variable."""
    if isinstance(given, KernelCaps):
        return {f: getattr(given, f) for f in FEATURES.values()}
    if given is not None:
        if not isinstance(given, str):
            raise TypeError(f"kernel_caps must be a str or KernelCaps, not {type(given).__name__}")
        return parse_overrides(given)
    return parse_overrides(os.environ.get(ENV_KERNEL_CAPS, ""), variable=ENV_KERNEL_CAPS)


_lock = threading.Lock()
_advice: dict[str, bool] | None = None
_windows: dict[int, tuple[bool, str]] = {}  # st_dev -> measured (window faults, detail)


def advice_supported() -> dict[str, bool]:
    """``{"populate_read", "pageout", "cold"}`` -> whether ``madvise`` accepts it (once per process).

    Asked on a one-page anonymous mapping, where each is harmless. ``EINVAL``
    is the kernel's answer for advice it does not know; any other refusal
    (a seccomp filter's ``EPERM``/``ENOSYS``) counts as unavailable too.
    """
    global _advice
    with _lock:
        if _advice is None:
            found = {}
            m = mmap.mmap(-1, mmap.PAGESIZE)
            try:
                for name, advice in _ADVICE.items():
                    try:
                        m.madvise(advice)
                        found[name] = True
                    except OSError as exc:
                        found[name] = False
                        logger.debug("madvise advice %d (%s) refused: %s", advice, name, exc)
            finally:
                m.close()
            _advice = found
        return dict(_advice)


def _probe_offsets(size: int) -> list[int]:
    """Up to PROBE_CANDIDATES whole 2 MiB windows of a file, spread over it.

    Local ranks probing the same file at once start at different windows
    (by process id): one's drop or read never lands in the window another
    is measuring.
    """
    n = size // WINDOW
    if n <= 0:
        return []
    picks = sorted({(n - 1) * k // max(1, PROBE_CANDIDATES - 1) for k in range(PROBE_CANDIDATES)}, reverse=True)
    r = os.getpid() % len(picks)
    return [k * WINDOW for k in picks[r:] + picks[:r]]


def measure_window_faults(fd: int) -> tuple[bool | None, str]:
    """Whether one fault reads a whole 2 MiB window of the file open as ``fd``; None when it cannot tell.

    Looks for an aligned 2 MiB window of the file with no page in the page
    cache, maps it ``MADV_HUGEPAGE`` + ``MADV_RANDOM`` (as the manager maps
    layers), faults its first page in, and counts the window's pages now
    resident (``mincore``): 2 MiB when faults read windows, 4 KiB when they
    read their page. The window is then dropped (``POSIX_FADV_DONTNEED``):
    the file's cache is left as it was found. Costs one read of at most
    2 MiB. A file whose every window looked at is partly cached tells
    nothing (None).
    """
    try:
        size = os.fstat(fd).st_size
    except OSError as exc:
        return None, f"fstat failed ({exc})"
    for off in _probe_offsets(size):
        try:
            before, after = _core.probe_fault_window(fd, off, WINDOW, True)
        except OSError as exc:
            return None, f"the file cannot be mapped ({exc})"
        if before:
            continue
        try:
            os.posix_fadvise(fd, off, WINDOW, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        return after > WINDOW // 2, f"measured: one fault read {format_bytes(after)} of a cold 2 MiB window"
    return None, "no cold 2 MiB window to measure in"


def infer_window_faults(release: str) -> tuple[bool, str]:
    """The fallback when nothing can be measured: 5.18+ with transparent huge pages built in."""
    m = re.match(r"(\d+)\.(\d+)", release)
    version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    thp = os.path.isdir("/sys/kernel/mm/transparent_hugepage")
    ok = version >= (5, 18) and thp
    return ok, f"inferred: kernel {'>=' if version >= (5, 18) else '<'} 5.18, THP {'on' if thp else 'off'}"


def kernel_caps(fd: int | None = None, given: str | KernelCaps | dict[str, bool] | None = None) -> KernelCaps:
    """The capabilities that apply to mappings of the file open as ``fd``.

    Parameters
    ----------
    fd
        A descriptor on the mapped file: window faults are measured on its
        device (once per device per process). None: inferred.
    given
        What to assume instead of finding out (text as for
        ``MAPOFFLOAD_KERNEL_CAPS``, a whole :class:`KernelCaps`, or what
        :func:`overrides` made of either). None: the environment variable,
        if set.

    Raises
    ------
    EnvSettingError, ValueError
        The variable or ``given`` holds a token it does not accept.
    """
    if isinstance(given, KernelCaps):
        return given
    said = dict(given) if isinstance(given, dict) else overrides(given)
    release = os.uname().release
    fields = {}
    advice = advice_supported() if set(_ADVICE) - set(said) else {}
    for name in _ADVICE:
        fields[name] = said[name] if name in said else advice[name]
    parts = []
    if "large_folios" in said:
        fields["large_folios"] = said["large_folios"]
    else:
        measured: tuple[bool | None, str] = (None, "no file to measure on")
        dev = None
        if fd is not None:
            try:
                dev = os.fstat(fd).st_dev
            except OSError:
                dev = None
        if dev is not None:
            with _lock:
                cached = _windows.get(dev)
            if cached is not None:
                measured = cached
            else:
                measured = measure_window_faults(fd)
                if measured[0] is not None:
                    with _lock:
                        _windows[dev] = measured  # type: ignore[assignment]
        if measured[0] is None:
            ok, why = infer_window_faults(release)
            fields["large_folios"] = ok
            parts += [why, measured[1]]
        else:
            fields["large_folios"] = measured[0]
            parts.append(measured[1])
    if said:
        parts.append("given: " + ", ".join(("" if v else "no-") + k.replace("_", "-") for k, v in said.items()))
    return KernelCaps(release=release, how="; ".join(parts), **fields)


def forget_measurements() -> None:
    """Forget what was measured (tests)."""
    global _advice
    with _lock:
        _advice = None
        _windows.clear()
