"""A lab comes up idempotently and goes down leaving nothing on the host (real lab)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from podmigrate import procs
from podmigrate.errors import LabError, UsageError
from podmigrate.lab import host, tunables
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage

from .conftest import disown, own, run_lab_name

pytestmark = pytest.mark.lab


def namespaces(pid: int) -> set[str]:
    """The mount and network namespaces of a process (e.g. 'mnt:[4026532845]')."""
    return {os.readlink(f"/proc/{pid}/ns/{kind}") for kind in ("mnt", "net")}


def holders_of(spaces: set[str]) -> list[int]:
    """Live processes anywhere on the machine in any of these namespaces."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if (
                    namespaces(int(pid)) & spaces
                    and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                ):
                    found.append(int(pid))
    return found


def lab_processes(the_lab: Lab, live_only: bool = False) -> list[int]:
    """Processes in the lab's cgroup tree. Killed ones linger as zombies until PID 1 reaps them;
    ``live_only`` leaves out those (dead, reparented to PID 1)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and procs.in_cgroup(int(pid), "/" + the_lab.cgroup.name):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if live_only and stat[0] == "Z" and stat[1] == "1":
                continue
            found.append(int(pid))
    return found


def is_up(lab_dir: Path) -> bool:
    return host.holder_pid(lab_dir) is not None


def sysctl(path: str) -> int:
    return int(Path("/proc/sys", path).read_text())


def test_lab_up_then_down_leaves_no_namespace_mount_process_cgroup_or_file_of_its_own():
    """Only what this lab made is checked: other labs and test runs may come and go meanwhile."""
    the_lab = Lab(run_lab_name("life"))
    own(the_lab.name)
    settings = ("fs/pipe-max-size", "net/netfilter/nf_conntrack_buckets")
    alone_before, before = not tunables.users(is_up), [sysctl(p) for p in settings]
    st = the_lab.up(nodes=2)
    assert st["up"] and [n["name"] for n in st["nodes"]] == ["node-a", "node-b"]
    assert all("criu" in n["agent"] for n in st["nodes"]), [(n["name"], n["agent"]) for n in st["nodes"]]
    # something real to clean up: a running workload with overlay mounts, conmon and a route
    manage.start(the_lab, "life", "node-b", 16)
    assert lab_processes(the_lab)
    # the lab's own: the lab holder shares the host's network namespace, which is not the lab's
    spaces = namespaces(st["pid"]) | namespaces(the_lab.node_pid("node-a")) | namespaces(the_lab.node_pid("node-b"))
    spaces -= namespaces(os.getpid())
    assert len(spaces) == 5
    assert str(the_lab.dir) in tunables.users(is_up)
    assert sysctl("fs/pipe-max-size") >= 4194304 and sysctl("net/netfilter/nf_conntrack_buckets") <= 16384
    again = the_lab.up(nodes=2)  # idempotent: same lab, nothing restarted
    assert again["pid"] == st["pid"]
    with pytest.raises(UsageError, match="already up with 2 nodes"):
        the_lab.up(nodes=3)

    cgroup = the_lab.cgroup
    the_lab.down()
    disown(the_lab.name)
    assert lab_processes(the_lab, live_only=True) == []
    assert holders_of(spaces) == []  # its namespaces are gone with their last process
    assert not cgroup.exists()
    assert not the_lab.dir.exists()
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if str(the_lab.dir) in line]  # nothing of it mounted on the host
    # the machine-wide settings: kept while another lab needs them, else back as they were
    left = tunables.users(is_up)
    assert str(the_lab.dir) not in left
    if alone_before and not left:
        assert [sysctl(p) for p in settings] == before and not list(tunables.STATE.glob("*.orig"))
    assert not the_lab.is_up()


def test_commands_on_a_lab_that_is_not_up_say_so():
    down = Lab(run_lab_name("never"))
    assert down.status() == {"name": down.name, "up": False, "state_dir": str(down.dir)}
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
