"""Kernel settings the lab changes on the machine: its nodes share the host's kernel, so these are
machine-wide, and every lab on the machine (any user's, any ``PODMIGRATE_HOME``) shares them.

They are changed under one machine-wide lock in ``/run/podmigrate/tunables`` (a tmpfs: it goes at
reboot, as the kernel's values do). There each lab that needs them has a user file, and the first
one keeps each old value (``<name>.orig``); ``release`` removes the lab's own user file and, when no
live user is left, puts the old values back. A user is live while the process that registered it
runs (``lab up`` in progress) or while its lab is up (``host.holder_pid``), so a lab that died
without ``lab down`` does not keep the settings for ever. A node of a real cluster would carry the
same settings (the docs say so). Standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from podmigrate import filelock, procs

PROC_SYS = Path("/proc/sys")
STATE = Path("/run/podmigrate/tunables")


@dataclass(frozen=True)
class Tunable:
    path: str  # under /proc/sys
    value: int
    at_least: bool  # raise to value (else lower to it)
    why: str

    def needs(self, current: int) -> bool:
        return current < self.value if self.at_least else current > self.value


TUNABLES = (
    Tunable(
        "fs/pipe-max-size",
        4194304,
        True,
        "CRIU's lazy-pages daemon needs 4 MiB pipes and has no CAP_SYS_RESOURCE here",
    ),
    # CRIU dumps a network namespace's conntrack entries and expectations (criu/net.c dump_nf_ct,
    # also for podman's external network namespaces) with two netlink dumps that walk the kernel's whole
    # conntrack hash: 11-12 ms each at the 262,144 buckets the kernel sized for 24 GiB, 0.7-1.9 ms at
    # 16,384, inside every dump's freeze. The table's size limit (nf_conntrack_max) is left as it is.
    Tunable(
        "net/netfilter/nf_conntrack_buckets",
        16384,
        False,
        "each CRIU dump walks the whole conntrack hash twice while the container is frozen",
    ),
)

LabUp = Callable[[Path], bool]  # is the lab with this state directory up?


@contextlib.contextmanager
def _locked(state: Path) -> Iterator[None]:
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state / "users").mkdir(exist_ok=True, mode=0o700)
    with filelock.held(state / "lock"):
        yield


def _user_file(state: Path, lab_dir: Path) -> Path:
    key = hashlib.sha256(os.path.realpath(lab_dir).encode()).hexdigest()[:16]
    return state / "users" / key


def _live_users(state: Path, lab_up: LabUp) -> list[str]:
    """The labs registered as needing the settings that still do; dead entries are removed."""
    live = []
    for f in sorted((state / "users").iterdir()):
        try:
            entry = json.loads(f.read_text())
            starter = procs.parse(entry["starter"])
            lab_dir = Path(entry["lab_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            f.unlink(missing_ok=True)
            continue
        if (starter is not None and procs.alive(starter)) or lab_up(lab_dir):
            live.append(str(lab_dir))
        else:
            f.unlink(missing_ok=True)
    return live


def acquire(
    lab_dir: Path,
    lab_up: LabUp,
    tunables: tuple[Tunable, ...] = TUNABLES,
    root: Path = PROC_SYS,
    state: Path = STATE,
    legacy: Path | None = None,
) -> list[str]:
    """Register ``lab_dir`` as needing the settings and set what needs setting, keeping each old
    value once; what was changed, as 'path: old -> new'. ``legacy``: a home where labs of an
    earlier version kept the old values (``<name>.orig`` beside the labs), taken over."""
    changed = []
    with _locked(state):
        _live_users(state, lab_up)  # drops entries of labs that died without `lab down`
        me = procs.identify(os.getpid())
        _user_file(state, lab_dir).write_text(json.dumps({"lab_dir": str(lab_dir), "starter": str(me)}))
        for t in tunables:
            f = root / t.path
            try:
                current = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):  # not in this kernel: nothing to tune
                continue
            orig = state / f"{Path(t.path).name}.orig"
            old = legacy / orig.name if legacy else None
            if old is not None and old.exists():  # the value before that version's lab changed it
                if not orig.exists():
                    orig.write_text(old.read_text())
                old.unlink()
            if not t.needs(current):
                continue
            if not orig.exists():
                orig.write_text(str(current))
            f.write_text(str(t.value))
            changed.append(f"{t.path}: {current} -> {t.value}")
    return changed


def release(
    lab_dir: Path,
    lab_up: LabUp,
    tunables: tuple[Tunable, ...] = TUNABLES,
    root: Path = PROC_SYS,
    state: Path = STATE,
    unregistered: Callable[[], list[str]] = list,
) -> list[str]:
    """``lab_dir`` no longer needs the settings; the last live user out puts the old values back.
    The labs still needing them (``lab_up`` says whether a lab is up; this one is not counted;
    ``unregistered``: labs up that an earlier version started, which never registered)."""
    if not state.exists():
        return []
    with _locked(state):
        _user_file(state, lab_dir).unlink(missing_ok=True)
        others = [d for d in _live_users(state, lab_up) if d != str(lab_dir)] + unregistered()
        if others:
            return others
        for t in tunables:
            orig = state / f"{Path(t.path).name}.orig"
            if orig.exists():
                with contextlib.suppress(OSError):
                    (root / t.path).write_text(orig.read_text())
                orig.unlink()
    return []


def users(lab_up: LabUp, state: Path = STATE) -> list[str]:
    """The state directories of the labs that need the settings now."""
    if not state.exists():
        return []
    with _locked(state):
        return _live_users(state, lab_up)
