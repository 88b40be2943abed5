"""Kernel settings the lab changes on the machine: its nodes share the host's kernel, so these are
machine-wide. The first lab up keeps each old value beside the labs (``<name>.orig``), the last lab
down puts it back. A node of a real cluster would carry the same settings (the docs say so).
Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_SYS = Path("/proc/sys")


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
    # also for podman's external namespaces) with two netlink dumps that walk the kernel's whole
    # conntrack hash: 11-12 ms each at the 262,144 buckets the kernel sized for 24 GiB, 0.7-1.9 ms at
    # 16,384, inside every dump's freeze. The table's size limit (nf_conntrack_max) is left as it is.
    Tunable(
        "net/netfilter/nf_conntrack_buckets",
        16384,
        False,
        "each CRIU dump walks the whole conntrack hash twice while the container is frozen",
    ),
)


def apply(base: Path, tunables: tuple[Tunable, ...] = TUNABLES, root: Path = PROC_SYS) -> list[str]:
    """Set what needs setting, keeping the old value once; what was changed, as 'path: old -> new'."""
    changed = []
    for t in tunables:
        f = root / t.path
        try:
            current = int(f.read_text().split()[0])
        except (OSError, ValueError, IndexError):  # not in this kernel: nothing to tune
            continue
        if not t.needs(current):
            continue
        orig = base / f"{Path(t.path).name}.orig"
        if not orig.exists():
            orig.write_text(str(current))
        f.write_text(str(t.value))
        changed.append(f"{t.path}: {current} -> {t.value}")
    return changed


def restore(
    base: Path, others_up: Callable[[], bool], tunables: tuple[Tunable, ...] = TUNABLES, root: Path = PROC_SYS
) -> None:
    """Put the old values back, unless another lab is still up (``others_up``)."""
    origs = [(t, base / f"{Path(t.path).name}.orig") for t in tunables]
    if not any(o.exists() for _, o in origs) or others_up():
        return
    for t, orig in origs:
        if orig.exists():
            (root / t.path).write_text(orig.read_text())
            orig.unlink()
