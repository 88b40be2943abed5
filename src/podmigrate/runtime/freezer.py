"""Freeze a container's cgroup the moment CRIU starts, so that CRIU does not wait 100 ms for it.

CRIU's freeze_processes() writes the cgroup's freeze file, reads the state back at once and, if the
tasks are not all frozen yet (a cgroup v2 freeze completes asynchronously, as each task next leaves
the kernel), sleeps 100 ms before looking again. On this machine that sleep hit 6 of 10 lazy dumps
of a 1 GB heap: the time from the last answer to CRIU serving pages was 0.07-0.14 s without it and
0.17-0.21 s with it.

CRIU skips the write and the wait when it finds the cgroup frozen already. Freezing it when podman
starts would stop the service during podman's and runc's own start-up (some 30-80 ms); instead an
inotify watch on the CRIU configuration file that runc hands over fires when CRIU opens it, a few
milliseconds before CRIU would freeze the cgroup itself. Standard library only (inotify via libc).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path

IN_OPEN = 0x20
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC


def cgroup_dir(pid: int, root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The cgroup v2 directory of process ``pid`` (None if it has none, or it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                d = root / line[3:].lstrip("/")
                return d if (d / "cgroup.freeze").exists() else None
    except OSError:
        return None
    return None


def frozen(cgroup: Path) -> bool:
    with contextlib.suppress(OSError):
        return "frozen 1" in (cgroup / "cgroup.events").read_text()
    return False


def traced(tid: int) -> bool:
    """Whether a debugger (here: CRIU) has seized thread ``tid``."""
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1]) != 0
    except (OSError, ValueError):
        return False
    return False


def _freeze_file(cgroup: Path) -> str | None:
    try:
        return (cgroup / "cgroup.freeze").read_text().strip()
    except OSError:
        return None


def thaw(cgroup: Path) -> bool:
    """Thaw ``cgroup`` if it is frozen; True if it was."""
    try:
        if (cgroup / "cgroup.freeze").read_text().strip() != "1":
            return False
        (cgroup / "cgroup.freeze").write_text("0")
    except OSError:
        return False
    return True


class FreezeOnOpen:
    """Freeze ``cgroup`` when ``watched`` is next opened (by anyone), once, within ``timeout`` s;
    ``times["opened_at"]`` says when that was (CRIU's start: the blackout breakdown's anchor for the
    timestamps of CRIU's log). With ``cgroup`` None it only records the time."""

    def __init__(self, watched: Path, cgroup: Path | None, timeout: float = 60.0):
        self.watched, self.cgroup, self.timeout = watched, cgroup, timeout
        self.times: dict[str, float] = {}
        self.error: str | None = None
        self._stop_r, self._stop_w = os.pipe()
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self._fd, os.fsencode(str(watched)), IN_OPEN) < 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"inotify_add_watch {watched}")
        self._thread = threading.Thread(target=self._wait, name="freeze-on-open", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        ready, _, _ = select.select([self._fd, self._stop_r], [], [], self.timeout)
        if self._fd not in ready:
            return
        self.times["opened_at"] = time.time()
        with contextlib.suppress(OSError):
            os.read(self._fd, 4096)  # the event itself does not matter, only that it came
        if self.cgroup is None:
            return
        try:
            (self.cgroup / "cgroup.freeze").write_text("1")
        except OSError as e:  # the container is gone: CRIU will say so itself
            self.error = f"freezing {self.cgroup}: {e}"
            return
        self.times["frozen_by_us_at"] = time.time()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not frozen(self.cgroup):
            # CRIU may see our freeze half done, seize the tasks as they stop and thaw the cgroup
            # before this loop sees "frozen 1": nothing is left to wait for then. Waiting on (the
            # dump's caller joins this thread once CRIU serves) held 1 of ~15 lazy dumps for 1 s.
            if _freeze_file(self.cgroup) == "0":
                self.times["thawed_by_criu_at"] = time.time()
                return
            if self._stopped(0.0005):  # the dump is done with the freezer
                return
        self.times["frozen_at"] = time.time()
        self._watchdog()

    def _watchdog(self) -> None:
        assert self.cgroup is not None
        """Undo a freeze that came too late. On a loaded machine this thread can see the open when
        CRIU has already frozen, seized and thawed the tasks itself; freezing them again then stops
        the parasite code CRIU runs in them, and the dump waits forever. Every task traced (by CRIU)
        while the cgroup is frozen means just that: thawing leaves them in ptrace-stop, as CRIU wants."""
        while not self._stopped(0.02):
            try:
                if (self.cgroup / "cgroup.freeze").read_text().strip() != "1":
                    return  # CRIU thawed it: it is past the point where a freeze matters
                tids = (self.cgroup / "cgroup.threads").read_text().split()
            except OSError:
                return
            if tids and all(traced(int(t)) for t in tids):
                thaw(self.cgroup)
                self.times["thawed_late_freeze_at"] = time.time()
                return

    def _stopped(self, wait: float) -> bool:
        ready, _, _ = select.select([self._stop_r], [], [], wait)
        return bool(ready)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(5)
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)


@contextlib.contextmanager
def freeze_when_opened(watched: Path, cgroup: Path | None) -> Iterator[FreezeOnOpen | None]:
    """While the block runs, freeze ``cgroup`` as soon as ``watched`` is opened (only noting when,
    if ``cgroup`` is None; nothing if ``watched`` cannot be watched: this only saves time). If the
    block raises, the operation failed and the source must run again: the cgroup is thawed."""
    try:
        watcher: FreezeOnOpen | None = FreezeOnOpen(watched, cgroup)
    except OSError:  # no such file (runc hands CRIU no configuration): CRIU freezes on its own
        watcher = None
    try:
        yield watcher
    except BaseException:
        if cgroup is not None:
            thaw(cgroup)
        raise
    finally:
        if watcher:
            watcher.close()
