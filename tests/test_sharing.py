"""Sharing a machine with other labs and users, without a lab: processes known by pid and start time
and signalled through a pidfd, claims that free when their process is gone even if its pid is reused,
and the machine-wide kernel settings kept while any lab needs them."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from podmigrate import layout, procs
from podmigrate.claims import Claims
from podmigrate.lab import tunables
from tests.conftest import wait_for


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_pid_file_names_its_process_by_pid_and_start_time(tmp_path: Path) -> None:
    child = sleeper()
    try:
        written = procs.write_pidfile(tmp_path / "x.pid", child.pid)
        assert written is not None and procs.read_pidfile(tmp_path / "x.pid") == written
        assert (tmp_path / "x.pid").read_text() == f"{child.pid} {written.start}\n"
        # the same pid with another start time is another process: not signalled, not alive
        impostor = procs.Proc(child.pid, written.start + 1)
        assert not procs.alive(impostor)
        assert procs.kill(impostor, signal.SIGKILL) is False
        assert child.poll() is None
        (tmp_path / "y.pid").write_text(f"{child.pid} {written.start + 1}\n")
        assert procs.read_pidfile(tmp_path / "y.pid") is None
    finally:
        child.kill()
        child.wait()
    assert procs.read_pidfile(tmp_path / "x.pid") is None  # gone and reaped


def test_a_kill_is_refused_outside_the_named_cgroup_and_stop_waits_for_the_exit() -> None:
    child = sleeper()
    p = procs.identify(child.pid)
    assert p is not None
    own = procs.cgroup_of(child.pid)
    assert own is not None
    assert procs.kill(p, signal.SIGTERM, cgroup="/podmigrate-no-such-lab") is False
    assert child.poll() is None
    assert procs.in_cgroup(child.pid, own) and procs.in_cgroup(child.pid, "/")
    reaper = threading.Thread(target=child.wait)
    reaper.start()
    assert procs.stop(p, cgroup=own, timeout=10)
    reaper.join(10)
    assert child.returncode == -signal.SIGTERM


def test_a_service_that_exited_but_is_not_reaped_is_alive_but_not_running() -> None:
    """A zombie keeps its pid (alive: nothing may reuse it) but runs nothing: a supervisor that took
    it for running would not start the service again (etcd restarted under a dead parent did that)."""
    child = sleeper()
    p = procs.identify(child.pid)
    assert p is not None and procs.running(p)
    os.kill(child.pid, signal.SIGKILL)
    wait_for(lambda: not procs.running(p), 10, "the child to exit")
    assert procs.alive(p)  # not reaped yet: a zombie
    child.wait()
    assert not procs.alive(p) and not procs.running(p)


def test_a_claim_whose_pid_now_belongs_to_another_process_is_free(tmp_path: Path) -> None:
    claims = Claims(tmp_path)
    claims.take("web", "m1")
    assert claims.busy() == {"web": ("m1", os.getpid())}
    # this process's pid, another start time: the claimer died and its pid went to this process
    db = sqlite3.connect(claims.path)
    with db:
        db.execute("UPDATE claims SET start = start - 1")
    db.close()
    assert claims.busy() == {}
    claims.take("web", "m2")  # not refused
    assert claims.busy() == {"web": ("m2", os.getpid())}


def test_two_homes_give_a_lab_of_the_same_name_two_cgroups(tmp_path: Path) -> None:
    a, b = layout.cgroup_name("demo", "/var/lib/podmigrate"), layout.cgroup_name("demo", str(tmp_path))
    assert a != b and a.startswith("podmigrate-demo-") and b.startswith("podmigrate-demo-")
    (tmp_path / "link").symlink_to(tmp_path)
    assert layout.cgroup_name("demo", str(tmp_path / "link")) == b  # one home by any path


@pytest.fixture
def kernel(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    for d in (root / "fs", root / "net/netfilter"):
        d.mkdir(parents=True)
    (root / "fs/pipe-max-size").write_text("1048576\n")
    (root / "net/netfilter/nf_conntrack_buckets").write_text("262144\n")
    return root


def value(root: Path, name: str) -> str:
    return (root / name).read_text().strip()


def test_machine_settings_stay_while_any_lab_needs_them_and_the_last_one_out_restores(
    tmp_path: Path, kernel: Path
) -> None:
    state, up = tmp_path / "run", set[str]()

    def lab_up(d: Path) -> bool:
        return str(d) in up

    a, b = tmp_path / "home1/labs/a", tmp_path / "home2/labs/a"  # two users, one lab name
    kw = {"root": kernel, "state": state}
    changed = tunables.acquire(a, lab_up, **kw)  # type: ignore[arg-type]
    assert changed == ["fs/pipe-max-size: 1048576 -> 4194304", "net/netfilter/nf_conntrack_buckets: 262144 -> 16384"]
    up.add(str(a))
    assert tunables.acquire(b, lab_up, **kw) == []  # type: ignore[arg-type]
    up.add(str(b))
    assert (state / "nf_conntrack_buckets.orig").read_text() == "262144"
    up.discard(str(a))
    assert tunables.release(a, lab_up, **kw) == [str(b)]  # type: ignore[arg-type]
    assert value(kernel, "fs/pipe-max-size") == "4194304"
    up.discard(str(b))
    assert tunables.release(b, lab_up, **kw) == []  # type: ignore[arg-type]
    assert value(kernel, "fs/pipe-max-size") == "1048576"
    assert value(kernel, "net/netfilter/nf_conntrack_buckets") == "262144"
    assert not list((state / "users").iterdir()) and not list(state.glob("*.orig"))


def test_a_lab_that_died_without_lab_down_does_not_hold_the_settings(tmp_path: Path, kernel: Path) -> None:
    state = tmp_path / "run"
    dead = tmp_path / "labs/dead"
    tunables.acquire(dead, lambda d: False, root=kernel, state=state)
    # its registrant: a process long gone (pid 1's start time is not this one's)
    (f,) = (state / "users").iterdir()
    f.write_text(json.dumps({"lab_dir": str(dead), "starter": "1 999999999999"}))
    live = tmp_path / "labs/live"
    tunables.acquire(live, lambda d: False, root=kernel, state=state)
    assert tunables.users(lambda d: False, state=state) == [str(live)]  # the registrant (this process) runs
    assert tunables.release(live, lambda d: False, root=kernel, state=state) == []
    assert value(kernel, "fs/pipe-max-size") == "1048576"


def test_an_earlier_versions_kept_values_are_taken_over(tmp_path: Path, kernel: Path) -> None:
    state, home = tmp_path / "run", tmp_path / "home"
    home.mkdir()
    (kernel / "fs/pipe-max-size").write_text("4194304\n")  # a lab of the earlier version raised it
    (home / "pipe-max-size.orig").write_text("65536")
    tunables.acquire(home / "labs/x", lambda d: False, root=kernel, state=state, legacy=home)
    assert (state / "pipe-max-size.orig").read_text() == "65536" and not (home / "pipe-max-size.orig").exists()
    tunables.release(home / "labs/x", lambda d: False, root=kernel, state=state)
    assert value(kernel, "fs/pipe-max-size") == "65536"


def test_labs_coming_up_at_once_keep_the_true_old_value(tmp_path: Path, kernel: Path) -> None:
    state = tmp_path / "run"
    labs = [tmp_path / f"labs/l{i}" for i in range(8)]
    threads = [
        threading.Thread(target=tunables.acquire, args=(d, lambda _d: True), kwargs={"root": kernel, "state": state})
        for d in labs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (state / "pipe-max-size.orig").read_text() == "1048576"
    for i, d in enumerate(labs):  # each registered by this (live) process: the last one out restores
        left = tunables.release(d, lambda _d: False, root=kernel, state=state)
        assert sorted(left) == sorted(str(x) for x in labs[i + 1 :])
    assert value(kernel, "fs/pipe-max-size") == "1048576"


def test_a_value_on_the_right_side_or_missing_in_this_kernel_is_left_alone(tmp_path: Path, kernel: Path) -> None:
    state = tmp_path / "run"
    (kernel / "fs/pipe-max-size").write_text("8388608")
    (kernel / "net/netfilter/nf_conntrack_buckets").unlink()
    assert tunables.acquire(tmp_path / "labs/x", lambda d: False, root=kernel, state=state) == []
    assert not list(state.glob("*.orig"))
