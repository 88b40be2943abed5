"""Free the registry's disk: deleting a checkpoint image removes its tag, not its blobs.

distribution's registry frees blobs only in ``garbage-collect``, which must not run while the
registry serves (a push in flight could lose a blob). ``collect`` stops the lab's registry (the
supervisor's hold file keeps it down), runs ``docker-registry garbage-collect --delete-untagged``
on its storage, and lets the supervisor start it again. ``podmigrate gc`` runs it when no migration
holds a claim (``podmigrate.claims``); the other images (the workload's, the pause image) are tagged and stay.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from podmigrate import layout, procs
from podmigrate.claims import Claims
from podmigrate.errors import LabError
from podmigrate.lab.cluster import Lab


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _stop_registry(lab: Lab, timeout: float) -> None:
    """Stop this lab's registry process, found by its pid file and checked to be in the lab's cgroup:
    every lab's registry has the same command line. The supervisor may have restarted it just before
    it saw the hold file, so the pid file is read again until the process it names is gone."""
    deadline = time.monotonic() + timeout
    while (p := lab.service("registry")) is not None:
        if time.monotonic() > deadline:
            raise LabError(
                f"the registry of lab {lab.name!r} (pid {p.pid}) did not stop for garbage collection",
                hint="podmigrate lab status; its log is in the lab's logs/registry.log",
            )
        if procs.kill(p, signal.SIGTERM, lab.cgroup_path):
            procs.wait_gone(p, max(0.1, deadline - time.monotonic()))
        time.sleep(0.3)  # one supervisor round (0.2 s): a restart it began before the hold shows now


def collect(lab: Lab, timeout: float = 60.0) -> dict[str, int]:
    """Blobs no tag references, deleted; bytes before and after."""
    Claims(lab.dir).refuse_if_busy("collect the registry's garbage")
    storage = lab.dir / "registry"
    before = disk_bytes(storage)
    hold = lab.dir / "hold" / "registry"
    hold.touch()
    try:
        _stop_registry(lab, timeout)
        config = f"{layout.IN_LAB_STATE}/registry.yml"
        lab.run("lab", ["docker-registry", "garbage-collect", "--delete-untagged", config], timeout=600)
    finally:
        hold.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    while lab.run("lan", ["curl", "-sf", "-o", "/dev/null", f"http://{layout.REGISTRY}/v2/"], check=False).returncode:
        if time.monotonic() > deadline:
            raise LabError(
                "the lab's registry did not come back after garbage collection", hint="podmigrate lab status"
            )
        time.sleep(0.2)
    return {"bytes_before": before, "bytes_after": disk_bytes(storage)}
