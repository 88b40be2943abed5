"""One lock file, held with ``flock`` for the length of a ``with`` block: how labs, test runs and users
sharing a machine take turns at what they share (a lab's up and down, the machine-wide kernel
settings, the node-image store, the Kubernetes build). Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def held(path: Path, shared: bool = False, wait: bool = True, mode: int = 0o600) -> Iterator[bool]:
    """``path`` locked (exclusively unless ``shared``), made with its parents if missing. Yields
    whether the lock is held: False only when ``wait`` is off and another holder has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
