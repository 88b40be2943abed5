"""Wake page faults that CRIU's lazy-pages daemon dropped (standard library only).

CRIU 4.2's lazy-pages daemon answers a page fault with UFFDIO_COPY. When the process is changing its
address space at that moment (munmap, madvise: Python frees memory all the time), the kernel refuses
the copy with EAGAIN; CRIU counts the error as recoverable, puts the pages back on its background
list and forgets the fault. The faulting thread sleeps until the background transfer happens to
reach its page: at 1 GB, up to the whole transfer (seconds of blackout, seen in 2 of 9 runs).

The fix from outside: borrow the daemon's userfaultfds (pidfd_getfd) and issue UFFDIO_WAKE over the
whole address space every few milliseconds while it runs. A woken thread retries its access; if the
page is still missing the kernel reports a fresh fault, which the daemon serves (a page already on
its way is skipped by CRIU, and a duplicate copy gets EEXIST, which it ignores). With no waiter, a
wake costs one walk of an empty wait queue.

``usable`` tells whether a userfaultfd can be had here at all (the node's ``lazy_pages`` capability).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import platform
import struct
import subprocess
import threading
from typing import Any

SYS_PIDFD_GETFD = 438  # same number on every architecture (asm-generic)
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}  # not asm-generic on x86-64
# _IOR(0xAA, _UFFDIO_WAKE = 0x02, struct uffdio_range { __u64 start, len; })
UFFDIO_WAKE = (2 << 30) | (16 << 16) | (0xAA << 8) | 0x02
# the top of user space; only where it is a constant (x86-64 with 4-level page tables or without
# an explicit request for 57-bit addresses, which no CRIU-restored process makes)
TASK_SIZE = {"x86_64": (1 << 47) - 4096}


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def usable() -> bool:
    """Whether this process can open a userfaultfd, which a lazy-pages restore needs.

    The kernel must have it (``vm.unprivileged_userfaultfd`` exists), and nothing in the way (seccomp,
    missing privileges) may refuse the call: one is opened and closed again to tell. Where the
    syscall's number is not known here, the sysctl is all there is to go by."""
    if not os.path.exists("/proc/sys/vm/unprivileged_userfaultfd"):
        return False
    nr = SYS_USERFAULTFD.get(platform.machine())
    if nr is None:
        return True
    fd = _libc().syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        return False
    os.close(fd)
    return True


def userfaultfds(pid: int) -> list[int]:
    """The descriptor numbers of the userfaultfds that process ``pid`` holds."""
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[userfaultfd]":
                    out.append(int(fd))
    return sorted(out)


def _range() -> bytes | None:
    top = TASK_SIZE.get(platform.machine())
    if top is None:
        return None
    try:
        with open("/proc/sys/vm/mmap_min_addr") as f:
            low = int(f.read())
    except (OSError, ValueError):
        low = 65536
    low = max(4096, (low + 4095) // 4096 * 4096)
    return struct.pack("QQ", low, top - low)


class FaultWaker:
    """While a ``criu lazy-pages`` daemon runs, wake every thread waiting on its userfaultfds
    every ``interval`` seconds."""

    def __init__(self, daemon: subprocess.Popen[Any], interval: float = 0.002):
        self.daemon, self.pid, self.interval = daemon, daemon.pid, interval
        self.wakes = 0
        self.error: str | None = None
        self._fds: dict[int, int] = {}  # daemon's fd number -> our copy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"uffd-waker-{daemon.pid}", daemon=True)

    def start(self) -> FaultWaker:
        self._thread.start()
        return self

    def _refresh(self, pidfd: int) -> None:
        """Borrow the daemon's new userfaultfds, and give back those it closed: a userfaultfd lets
        go of the process's memory only when its last copy is closed, and until then a fault in a
        range it covers waits for a reader that no longer exists."""
        libc = _libc()
        held = {n: self._inode(n) for n in userfaultfds(self.pid)}
        for n, fd in list(self._fds.items()):
            if held.get(n) != os.fstat(fd).st_ino:  # closed, or the number now names another one
                os.close(fd)
                del self._fds[n]
        for n in held:
            if n not in self._fds:
                fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, n, 0)
                if fd >= 0:
                    self._fds[n] = fd

    def _inode(self, n: int) -> int | None:
        try:
            return os.stat(f"/proc/{self.pid}/fd/{n}").st_ino
        except OSError:
            return None

    def _loop(self) -> None:
        rng = _range()
        if rng is None:
            self.error = f"no fixed top of user space known on {platform.machine()}"
            return
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError as e:
            self.error = f"pidfd_open({self.pid}): {e}"
            return
        try:
            rounds = 0
            while not self._stop.is_set():
                # the daemon receives one userfaultfd per task during the restore, a new one when a
                # restored task forks, and closes each once its pages have all moved
                if not self._fds or rounds % 5 == 0:
                    self._refresh(pidfd)
                rounds += 1
                for n, fd in list(self._fds.items()):
                    try:
                        fcntl.ioctl(fd, UFFDIO_WAKE, rng)
                        self.wakes += 1
                    except OSError:  # the process exited or the daemon let go of it
                        os.close(fd)
                        del self._fds[n]
                if self.daemon.poll() is not None:
                    break
                self._stop.wait(self.interval)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            os.close(pidfd)

    def status(self) -> dict[str, Any]:
        alive = self._thread.is_alive()
        return {"running": alive, "wakes": self.wakes, "userfaultfds": len(self._fds), "error": self.error}

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        return self.status()
