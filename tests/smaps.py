"""What a process's mappings of a folder's files cost it, from ``/proc/PID/smaps`` (tests and benchmarks)."""

from __future__ import annotations

import os


def pss_under(pid: int, folder: str) -> int:
    """Sum of ``Pss`` over ``pid``'s mappings of files under ``folder`` (bytes): shared pages count
    once across the processes that map them."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split(maxsplit=5)
                inside = len(parts) > 5 and parts[5].strip().startswith(folder + os.sep)
            elif inside and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total
