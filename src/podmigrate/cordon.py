"""Cordoned nodes: no new workload starts there and no migration goes there (``podmigrate evacuate``
cordons the node it empties, as ``kubectl drain`` does). One file per node in ``<state>/cordoned/``,
so that every command, in any process, sees the same state; ``lab down`` removes it with the lab.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from podmigrate import names
from podmigrate.errors import UsageError


class StateDir(Protocol):  # a lab, a set of hosts: only its state directory is read
    dir: Path


def cordoned(lab: StateDir) -> set[str]:
    d = lab.dir / "cordoned"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def cordon(lab: StateDir, node: str, why: str) -> None:
    d = lab.dir / "cordoned"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / names.name(node, "node name")).write_text(why + "\n")


def uncordon(lab: StateDir, node: str) -> bool:
    """Whether it was cordoned."""
    p = lab.dir / "cordoned" / names.name(node, "node name")
    was = p.exists()
    p.unlink(missing_ok=True)
    return was


def refuse_if_cordoned(lab: StateDir, node: str, what: str) -> None:
    p = lab.dir / "cordoned" / names.name(node, "node name")
    if p.exists():
        raise UsageError(
            f"{node} is cordoned ({p.read_text().strip()}): {what} there is refused",
            hint=f"pick another node, or uncordon it: podmigrate lab uncordon {node}",
        )
