"""Cordoned nodes: no new workload starts there and no migration goes there (``podmigrate evacuate``
cordons the node it empties, as ``kubectl drain`` does). One file per node in ``<lab>/cordoned/``,
so that every command, in any process, sees the same state; ``lab down`` removes it with the lab.
"""

from __future__ import annotations

from podmigrate import names
from podmigrate.errors import UsageError
from podmigrate.lab.handle import LabHandle


def cordoned(lab: LabHandle) -> set[str]:
    d = lab.dir / "cordoned"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def cordon(lab: LabHandle, node: str, why: str) -> None:
    d = lab.dir / "cordoned"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / names.name(node, "node name")).write_text(why + "\n")


def uncordon(lab: LabHandle, node: str) -> bool:
    """Whether it was cordoned."""
    p = lab.dir / "cordoned" / names.name(node, "node name")
    was = p.exists()
    p.unlink(missing_ok=True)
    return was


def refuse_if_cordoned(lab: LabHandle, node: str, what: str) -> None:
    p = lab.dir / "cordoned" / names.name(node, "node name")
    if p.exists():
        raise UsageError(
            f"{node} is cordoned ({p.read_text().strip()}): {what} there is refused",
            hint=f"pick another node, or uncordon it: podmigrate lab uncordon {node}",
        )
