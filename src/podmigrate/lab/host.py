"""A lab's footprint on the host: its state directory, its cgroup2 subtree and the processes in it.

Helpers for ``cluster`` (the ``Lab`` handle) and ``lifecycle`` (up and down); they know the files a
lab keeps (``lab.pid``, ``ready``) but nothing of agents or nodes.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from podmigrate import procs
from podmigrate.errors import LabError

Report = Callable[[str], None]
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,19}$")


def home() -> Path:
    return Path(os.environ.get("PODMIGRATE_HOME", "/var/lib/podmigrate"))


def cgroup2_root() -> Path:
    """Where the host mounts the unified hierarchy (/sys/fs/cgroup/unified on hybrid hosts)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return Path(left.split()[4])
    raise LabError(
        "no cgroup2 hierarchy is mounted on the host",
        hint="mount -t cgroup2 none /sys/fs/cgroup/unified (hybrid) or boot with cgroup v2",
    )


def join(cgroup: Path) -> Callable[[], None]:
    """A ``preexec_fn`` that moves the child into ``cgroup``, so `lab down` finds and kills it."""

    def join() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    return join


def holder_pid(lab_dir: Path) -> int | None:
    """The lab holder's pid if it is alive, in its own mount namespace, and finished starting."""
    p = procs.read_pidfile(lab_dir / "lab.pid")
    try:
        ready = int((lab_dir / "ready").read_text())
    except (OSError, ValueError):
        return None
    if p is None or procs.same_mount_ns(p.pid) or not os.path.exists(f"/proc/{p.pid}/ns/mnt"):
        return None
    return p.pid if ready == p.pid else None


def reap(pidfile: Path) -> None:
    """Collect the lab holder's exit status if this process started it (else it stays a zombie)."""
    with contextlib.suppress(OSError, ValueError):
        p = procs.parse(pidfile.read_text())
        if p is not None:
            os.waitpid(p.pid, os.WNOHANG)


def rmdir(d: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the kernel finishes tearing the cgroup down
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def cgroup_pids(cg: Path) -> list[int]:
    pids: list[int] = []
    for f in [cg / "cgroup.procs", *cg.rglob("cgroup.procs")]:
        with contextlib.suppress(OSError):
            pids += [int(x) for x in f.read_text().split()]
    return pids
