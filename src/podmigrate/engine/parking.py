"""Parked workloads: checkpoints left in the registry when no node could take them in time.

An evacuation that cannot move a workload before its deadline, or ``podmigrate park``, checkpoints
it into the lab's registry and leaves it there (``engine.plans``: container / park); ``podmigrate
restore NAME --to NODE`` brings it back, state and all, later and anywhere (parked / stop-copy).
Between the two this store holds what the restore needs, one entry per workload in
``<lab>/parked/``: where the image is and its digests, the container's image, addresses and probe,
the state it was parked with (the restore checks the copy against it), and, in its own 0600 file,
the key the image is sealed with. The image at rest is ciphertext; the key stays on the controller's
host, never in a record or a log (SECURITY.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from podmigrate.engine.cluster import Cluster
from podmigrate.errors import UsageError
from podmigrate.names import name as valid_name


def _dir(lab: Cluster) -> Path:
    d = lab.dir / "parked"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _write(path: Path, text: str) -> None:
    """Whole or not at all, owner-only, and on disk before the park commits: the source's copy is
    removed right after, so the entry and its key may be all that opens the parked image."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a stale one would keep its own mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save(lab: Cluster, entry: dict[str, Any], key: str | None) -> None:
    """Park ``entry`` (its ``workload`` names it); the key first, so an entry always has its key."""
    name = valid_name(entry["workload"], "workload name")
    d = _dir(lab)
    if key:
        _write(d / f"{name}.key", key)
    _write(d / f"{name}.json", json.dumps(entry, indent=2, default=str) + "\n")


def load(lab: Cluster, workload: str) -> tuple[dict[str, Any], str | None]:
    """The parked entry of ``workload`` and its key (None if it was parked unsealed)."""
    name = valid_name(workload, "workload name")
    d = _dir(lab)
    try:
        entry: dict[str, Any] = json.loads((d / f"{name}.json").read_text())
    except FileNotFoundError:
        parked = ", ".join(e["workload"] for e in listing(lab)) or "none"
        raise UsageError(f"{workload!r} is not parked in lab {lab.name!r}", hint=f"parked: {parked}") from None
    key = None
    if entry.get("sealed"):
        try:
            key = (d / f"{name}.key").read_text().strip()
        except FileNotFoundError:
            raise UsageError(
                f"the key that {workload!r}'s parked checkpoint is sealed with is gone ({d / (name + '.key')})",
                hint=f"the image cannot be opened without it; remove {d / (name + '.json')} to forget the workload",
            ) from None
    return entry, key


def remove(lab: Cluster, workload: str) -> bool:
    """Forget a parked workload (after its restore, or an undone park); whether it was parked."""
    name = valid_name(workload, "workload name")
    d = _dir(lab)
    existed = (d / f"{name}.json").exists()
    (d / f"{name}.json").unlink(missing_ok=True)
    (d / f"{name}.key").unlink(missing_ok=True)
    return existed


def listing(lab: Cluster) -> list[dict[str, Any]]:
    out = []
    for p in sorted(_dir(lab).glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out
