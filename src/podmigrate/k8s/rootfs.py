"""A container's writes to its root file system, taken on its node for a streamed or lazy dump (the
kubelet's checkpoint archive carries them the same way): the overlay's upper directory as a tar.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def rootfs_diff(node: list[str], ctr: str, local: Path, there: Path) -> Path | None:
    """The container's writes to its root file system (as the kubelet's archive carries them), as a
    tar in the dump's work directory; None when its root is no overlay."""
    upper = upper_dir(node, ctr)
    if not upper:
        return None
    tar = [*node, "tar", "--numeric-owner", "-C", upper, "-cf", str(there / "work" / "rootfs-diff.tar"), "."]
    subprocess.run(tar, check=True, capture_output=True)
    return local / "work" / "rootfs-diff.tar"


def upper_dir(node: list[str], ctr: str) -> str | None:
    """The overlay upper directory of the container's root file system, in the node's mount namespace."""
    p = subprocess.run([*node, "cat", "/proc/self/mountinfo"], capture_output=True, text=True, check=True)
    for line in p.stdout.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4].endswith(f"/{ctr}/rootfs") and " - overlay " in line:
            opts = line.rsplit(" ", 1)[-1].split(",")
            return next((o.split("=", 1)[1] for o in opts if o.startswith("upperdir=")), None)
    return None
