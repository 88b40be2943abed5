"""The restored copy's transparent huge pages, put back once every page has arrived.

A process that asked for huge pages (``madvise(MADV_HUGEPAGE)``; numpy does for large arrays) has
its heap in 2 MB pages. CRIU restores the mapping's flag, but a lazy restore fills the memory through
userfaultfd (``UFFDIO_COPY``), 4 KB at a time: the copy runs with 512 times as many page-table
entries as the original (the TLB misses a workload asked to avoid), and the next migration's freeze
pays for them too, since the kernel walks every entry when CRIU reads ``/proc/PID/smaps`` and
``PAGEMAP_SCAN`` (10-25 ms at 1 GB). khugepaged would merge them back over minutes; once the
lazy-pages daemon has written the last page, ``collapse`` asks for it at once
(``process_madvise(MADV_COLLAPSE)``, Linux 6.1+), for the mappings that would have huge pages:
those flagged ``hg`` (madvised), and, when the kernel's THP mode is ``always``, every anonymous
private one not flagged ``nh``. The memory's content is unchanged; a range the kernel cannot collapse
(no free 2 MB page, say) stays as it is and is counted. Standard library only (ctypes for the call).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from pathlib import Path
from typing import Any

HUGE = 2 << 20
MADV_COLLAPSE = 25
SYS_PROCESS_MADVISE = 440  # x86_64
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's THP mode: always, madvise or never (the bracketed word)."""
    try:
        m = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return "never"
    return m.group(1) if m else "never"


def wanted(smaps: str, mode: str) -> list[tuple[int, int]]:
    """The 2 MB-aligned ranges inside the mappings of ``smaps`` (a /proc/PID/smaps text) that would
    hold huge pages under THP ``mode`` but do not have them all."""
    out: list[tuple[int, int]] = []
    head: tuple[int, int, str, int] | None = None
    huge_kb = 0
    for line in smaps.splitlines():
        m = _RANGE.match(line)
        if m:
            head = (int(m.group(1), 16), int(m.group(2), 16), m.group(3), int(m.group(4)))
            huge_kb = 0
        elif head and line.startswith("AnonHugePages:"):
            huge_kb = int(line.split()[1])
        elif head and line.startswith("VmFlags:"):
            start, end, perms, inode = head
            flags = set(line.split()[1:])
            private_anon = perms[3] == "p" and inode == 0 and "w" in perms
            eligible = "hg" in flags or (mode == "always" and "nh" not in flags)
            lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
            if mode != "never" and private_anon and eligible and hi > lo and huge_kb * 1024 < hi - lo:
                out.append((lo, hi))
            head = None
    return out


def collapse(pids: list[int], mode: str | None = None) -> dict[str, Any]:
    """Collapse the eligible ranges of every process in ``pids`` into huge pages; what was asked,
    what the kernel did, how long it took."""
    mode = mode or thp_mode()
    t0 = time.monotonic()
    res: dict[str, Any] = {"mode": mode, "ranges": 0, "bytes": 0, "collapsed_bytes": 0, "failed": {}}
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in pids:
        try:
            ranges = wanted(Path(f"/proc/{pid}/smaps").read_text(), mode)
            fd = os.pidfd_open(pid)
        except OSError:  # gone meanwhile: nothing to do for it
            continue
        try:
            for lo, hi in ranges:
                res["ranges"] += 1
                res["bytes"] += hi - lo
                # one huge page a call: a page the kernel cannot collapse fails alone, and is counted
                for at in range(lo, hi, HUGE):
                    iov = _IoVec(at, HUGE)
                    if libc.syscall(SYS_PROCESS_MADVISE, fd, ctypes.byref(iov), 1, MADV_COLLAPSE, 0) < 0:
                        why = errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
                        res["failed"][why] = res["failed"].get(why, 0) + 1
                    else:
                        res["collapsed_bytes"] += HUGE
        finally:
            os.close(fd)
    res["seconds"] = round(time.monotonic() - t0, 4)
    return res
