"""Processes by identity, never by name: a pid together with its start time, read from pid files
this project writes, signalled through a pidfd after checking it is still that process and, where
asked, that it lives in the expected cgroup.

Other labs, test runs and users share the machine and run the same programs with the same command
lines, so acting on a name or a pattern reaches theirs too, and a bare pid may by now belong to
someone else. Used on the host (``lab``, ``engine``) and inside the lab (``lab.init``, the agents):
standard library only.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal as signals
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # /proc/PID/stat field 22, clock ticks after boot: with the pid, unique until reboot

    def __str__(self) -> str:
        return f"{self.pid} {self.start}"


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` from field 3 (the state) on, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from its closing one
    return stat.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def identify(pid: int) -> Proc | None:
    """The live process ``pid`` is now, or None."""
    start = start_time(pid)
    return None if start is None else Proc(pid, start)


def alive(p: Proc) -> bool:
    """Whether ``p`` still runs (a zombie counts until it is reaped); a reused pid is not ``p``."""
    return start_time(p.pid) == p.start


def running(p: Proc) -> bool:
    """Whether ``p`` runs: alive and not a zombie (one that exited, whose parent has not reaped it yet;
    a service whose parent is gone waits on init's reaping)."""
    fields = _stat(p.pid)
    return fields is not None and int(fields[19]) == p.start and fields[0] not in ("Z", "X")


def parse(text: str) -> Proc | None:
    words = text.split()
    try:
        return Proc(int(words[0]), int(words[1]))
    except (IndexError, ValueError):
        return None


def write_pidfile(path: Path, pid: int) -> Proc | None:
    """Record ``pid`` with its start time (atomically: a reader never sees half a line)."""
    p = identify(pid)
    if p is not None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(f"{p}\n")
        tmp.replace(path)
    return p


def read_pidfile(path: Path) -> Proc | None:
    """The process a pid file names, if it still runs. A file with a pid alone (written before start
    times were) names whatever has that pid now."""
    try:
        text = path.read_text()
    except OSError:
        return None
    p = parse(text)
    if p is None and text.strip().isdigit():
        return identify(int(text))
    return p if p is not None and alive(p) else None


def cgroup_of(pid: int) -> str | None:
    """The process's cgroup2 path, as this process's cgroup namespace shows it."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    return next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)


def in_cgroup(pid: int, cgroup: str) -> bool:
    """Whether ``pid`` is in cgroup2 path ``cgroup`` (e.g. /podmigrate-x/lab) or below it."""
    cg = cgroup_of(pid)
    want = "/" + cgroup.strip("/")
    return cg is not None and (cg == want or cg.startswith(want + "/"))


def same_mount_ns(pid: int) -> bool:
    """Whether ``pid`` shares this process's mount namespace (a lab node's own processes do)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False


def open_fd(p: Proc, cgroup: str | None = None) -> int | None:
    """A pidfd of ``p`` if it is still that process (and in ``cgroup``, if given), else None. The
    checks run after the pidfd is open: a pidfd never moves to a new process, so once they pass, a
    signal through it reaches ``p`` or nothing."""
    try:
        fd = os.pidfd_open(p.pid)
    except (ProcessLookupError, OSError):
        return None
    if alive(p) and (cgroup is None or in_cgroup(p.pid, cgroup)):
        return fd
    os.close(fd)
    return None


def kill(p: Proc, sig: int = signals.SIGTERM, cgroup: str | None = None) -> bool:
    """Send ``sig`` to ``p`` if it is still that process; whether it was sent."""
    fd = open_fd(p, cgroup)
    if fd is None:
        return False
    try:
        signals.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def wait_gone(p: Proc, timeout: float) -> bool:
    """Wait until ``p`` has exited (its pidfd turns readable); whether it did within ``timeout``."""
    fd = open_fd(p)
    if fd is None:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    finally:
        os.close(fd)


def stop(p: Proc, cgroup: str | None = None, timeout: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; whether ``p`` is gone."""
    if not kill(p, signals.SIGTERM, cgroup):
        return not alive(p)
    if wait_gone(p, timeout):
        return True
    kill(p, signals.SIGKILL, cgroup)
    deadline = time.monotonic() + 5
    while alive(p) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(p.pid, os.WNOHANG)
        time.sleep(0.02)
    return not alive(p)
