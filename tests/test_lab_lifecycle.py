"""A lab comes up idempotently and goes down leaving nothing on the host (real lab)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from podmigrate.errors import LabError, UsageError
from podmigrate.lab.cluster import Lab, cgroup2_root
from podmigrate.workload import manage

pytestmark = pytest.mark.lab


def host_snapshot() -> dict[str, Any]:
    mnt_ns = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                mnt_ns.add(os.readlink(f"/proc/{pid}/ns/mnt"))
    with open("/proc/self/mountinfo") as f:
        mounts = sorted(line.split()[4] for line in f)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {
        "mnt_ns": mnt_ns,
        "mounts": mounts,
        "links": sorted(x.split(":")[1] for x in links.splitlines()),
        "netns": subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout,
        # raised for lazy pages while a lab is up; the last lab down puts it back
        "pipe_max": Path("/proc/sys/fs/pipe-max-size").read_text(),
        # lowered for CRIU's conntrack dumps while a lab is up (lab.tunables), the same way
        "ct_buckets": Path("/proc/sys/net/netfilter/nf_conntrack_buckets").read_text(),
    }


def lab_processes(name: str, live_only: bool = False) -> list[int]:
    """Processes in the lab's cgroup tree. Killed ones linger as zombies until PID 1 reaps them;
    ``live_only`` leaves out those (dead, reparented to PID 1)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if f"podmigrate-{name}" not in Path(f"/proc/{pid}/cgroup").read_text():
                    continue
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if live_only and stat[0] == "Z" and stat[1] == "1":
                continue
            found.append(int(pid))
    return found


def test_lab_up_then_down_leaves_no_namespace_mount_process_cgroup_or_file():
    the_lab = Lab("pmtest-life")
    the_lab.down()
    before = host_snapshot()
    st = the_lab.up(nodes=2)
    assert st["up"] and [n["name"] for n in st["nodes"]] == ["node-a", "node-b"]
    assert all("criu" in n["agent"] for n in st["nodes"])
    # something real to clean up: a running workload with overlay mounts, conmon and a route
    manage.start(the_lab, "life", "node-b", 16)
    assert lab_processes("pmtest-life")
    again = the_lab.up(nodes=2)  # idempotent: same lab, nothing restarted
    assert again["pid"] == st["pid"]
    with pytest.raises(UsageError, match="already up with 2 nodes"):
        the_lab.up(nodes=3)

    the_lab.down()
    after = host_snapshot()
    assert lab_processes("pmtest-life", live_only=True) == []
    assert not (cgroup2_root() / "podmigrate-pmtest-life").exists()
    assert not the_lab.dir.exists()
    assert after["mounts"] == before["mounts"]
    assert after["links"] == before["links"]
    assert after["netns"] == before["netns"]
    assert after["pipe_max"] == before["pipe_max"]  # another lab up (the session's) keeps it raised
    assert after["ct_buckets"] == before["ct_buckets"]
    assert set(after["mnt_ns"]) <= set(before["mnt_ns"])
    assert not the_lab.is_up()


def test_commands_on_a_lab_that_is_not_up_say_so():
    down = Lab("pmtest-never")
    assert down.status() == {"name": "pmtest-never", "up": False, "state_dir": str(down.dir)}
    with pytest.raises(LabError, match="not up"):
        manage.start(down, "x", "node-a", 16)
    with pytest.raises(LabError, match="not up"):
        down.run("node-a", ["true"])
    from podmigrate.engine.controller import Plan, migrate

    with pytest.raises(LabError, match="podmigrate lab up"):
        migrate(down, Plan(workload="web", target="node-b"))


def test_bad_lab_names_are_refused():
    with pytest.raises(UsageError, match="not a valid lab name"):
        Lab("../etc")
