"""Two labs on one machine (real labs): while lab A migrates a workload back and forth, lab B comes up,
migrates, collects its garbage and its registry's, loses its containerd and goes down. A keeps its
state, its registry and containerd processes, the machine settings it needs and its records.

Everything B does acts on B alone (by pid file, pidfd and cgroup, never by name): the defects this
catches are of that kind (B's registry collection once stopped processes by their command line,
which every lab's registry shares, and so stopped A's too)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from podmigrate import procs
from podmigrate.engine import gc
from podmigrate.engine.controller import Plan, migrate, store_for
from podmigrate.lab import registry_gc
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage
from podmigrate.workload.image import ready_lab

from .conftest import disown, own, run_lab_name, wait_for

pytestmark = pytest.mark.lab
PODMIGRATE = str(Path(sys.executable).with_name("podmigrate"))


def services(lab: Lab) -> dict[str, procs.Proc | None]:
    return {
        s: lab.service(s) for s in ("registry", "lan", "node-a", "node-b", "containerd-node-a", "containerd-node-b")
    }


def sysctls() -> tuple[int, int]:
    return (
        int(Path("/proc/sys/fs/pipe-max-size").read_text()),
        int(Path("/proc/sys/net/netfilter/nf_conntrack_buckets").read_text()),
    )


class BackAndForth(threading.Thread):
    """Lab A's workload migrated node-a <-> node-b by `podmigrate migrate` commands (another process
    each, as a user would run them) until stopped; every record kept."""

    def __init__(self, lab: Lab, name: str):
        super().__init__(daemon=True)
        self.lab, self.name = lab, name
        self.records: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        target = "node-b"
        while not self.done.is_set() or not self.records:
            p = subprocess.run(
                [PODMIGRATE, "--lab", self.lab.name, "migrate", self.name, "--to", target, "--json"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if p.returncode:
                self.failures.append(p.stdout[-2000:] + p.stderr[-2000:])
                return
            self.records.append(json.loads(p.stdout))
            target = "node-a" if target == "node-b" else "node-b"


def test_a_second_lab_comes_and_goes_beside_a_migrating_lab_and_touches_nothing_of_it(containerd_lab: Lab):
    a = containerd_lab
    st = manage.start(a, "twolabs", "node-a", 32)
    before = manage.state(a, "twolabs")
    a_services = services(a)
    assert all(a_services.values()), a_services
    a_settings = sysctls()
    mover = BackAndForth(a, "twolabs")
    b = Lab(run_lab_name("b"))
    own(b.name)
    mover.start()
    try:
        ready_lab(b, nodes=2, runtime="containerd", report=lambda m: print(f"[lab {b.name}] {m}", flush=True))
        manage.start(b, "bweb", "node-a", 16)
        # through B's registry: its checkpoint image's blobs are what B's garbage collection frees
        rec = migrate(b, Plan(workload="bweb", target="node-b", transport="registry"))
        assert rec["status"] == "completed"
        assert gc.collect(b) == {"archives": [], "images": [], "containers": [], "routes": []}
        freed = registry_gc.collect(b)
        assert freed["bytes_after"] < freed["bytes_before"]
        killed = b.kill_service("containerd-node-a", signal.SIGKILL)
        wait_for(lambda: b.service("containerd-node-a") not in (None, killed), 60, "B's containerd back")
        manage.stop(b, "bweb")
        b.down()
        disown(b.name)
    finally:
        mover.done.set()
        mover.join(900)
    assert not mover.failures, mover.failures
    assert len(mover.records) >= 1 and all(r["status"] == "completed" for r in mover.records)
    # A: the same processes, the settings it needs, every record, and the workload's memory
    assert services(a) == a_services
    assert sysctls() == a_settings
    ids = {r["id"] for r in store_for(a).list(limit=1000)}
    assert {r["id"] for r in mover.records} <= ids
    after = manage.state(a, "twolabs")
    assert after["sha256"] == before["sha256"] and after["counter"] >= before["counter"]
    assert after["ip"] == st["ip"]
    manage.stop(a, "twolabs")
