"""Run the calling thread (and the threads and processes it starts) in the lab's LAN network namespace.

A network namespace is a property of a thread (setns(2) with CLONE_NEWNET changes only the caller);
threads and child processes inherit it, and a socket stays in the namespace it was made in. The
control plane enters the LAN once, starts its servers and the operator there, and leaves again.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def lan_path(holder_pid: int) -> Path:
    """The LAN's namespace file, seen through the lab holder's mount namespace (it is bound in its /run)."""
    return Path(f"/proc/{holder_pid}/root/run/netns/lan")


@contextmanager
def entered(path: Path) -> Iterator[None]:
    """The calling thread in the network namespace ``path`` until the block ends."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def current() -> int:
    """The inode of the calling thread's network namespace (to compare namespaces)."""
    return os.stat("/proc/thread-self/ns/net").st_ino
