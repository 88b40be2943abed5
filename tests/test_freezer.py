"""Freezing a cgroup the moment a file is opened (how a dump gets its source frozen before CRIU looks),
on a real cgroup v2 of its own."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from podmigrate.lab.cluster import cgroup2_root
from podmigrate.runtime.freezer import cgroup_dir, freeze_when_opened, frozen, thaw

from .conftest import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating a cgroup needs root")


@pytest.fixture
def sleeper() -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A process alone in a fresh cgroup v2 (under the unified hierarchy, never a v1 one)."""
    root = cgroup2_root()
    cg = root / f"podmigrate-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    p = subprocess.Popen(["sleep", "300"])
    try:
        (cg / "cgroup.procs").write_text(str(p.pid))
        yield p, cg
    finally:
        thaw(cg)
        p.kill()
        p.wait()
        wait_for(lambda: not (cg / "cgroup.procs").read_text().strip(), 10, "the cgroup to empty")
        with contextlib.suppress(OSError):
            cg.rmdir()


def test_the_cgroup_freezes_when_the_file_is_opened_and_thaws_again(tmp_path: Path, sleeper) -> None:
    p, cg = sleeper
    assert cgroup_dir(p.pid, cgroup2_root()) == cg
    watched = tmp_path / "runc.conf"
    watched.write_text("tcp-established\n")
    with freeze_when_opened(watched, cg) as watcher:
        assert watcher is not None
        assert not frozen(cg)  # writing the file before the watch started did not count
        watched.read_text()  # what CRIU does first
        wait_for(lambda: frozen(cg), 10, "the cgroup to be frozen")
        wait_for(lambda: "frozen_at" in watcher.times, 5, "the watcher to see it frozen")
    assert frozen(cg)  # it stays frozen: the dump (here: nobody) decides what happens next
    assert thaw(cg)
    wait_for(lambda: not frozen(cg), 10, "the cgroup to thaw")
    assert not thaw(cg)  # thawing a thawed cgroup says it did nothing


def test_nothing_is_frozen_when_the_file_is_never_opened(tmp_path: Path, sleeper) -> None:
    _, cg = sleeper
    watched = tmp_path / "runc.conf"
    watched.write_text("")
    with freeze_when_opened(watched, cg) as watcher:
        assert watcher is not None
    assert not frozen(cg) and watcher.times == {}
    with freeze_when_opened(watched, None) as noted:  # a container without a cgroup v2 of its own
        assert noted is not None
        before = time.time()
        watched.read_text()
        wait_for(lambda: "opened_at" in noted.times, 5, "the watcher to note the open")
    assert before <= noted.times["opened_at"] <= time.time() and "frozen_at" not in noted.times
    with freeze_when_opened(tmp_path / "absent.conf", cg) as none:  # no configuration to watch
        assert none is None
    assert not frozen(cg)


def test_a_block_that_fails_thaws_the_cgroup_it_froze(tmp_path: Path, sleeper) -> None:
    _, cg = sleeper
    watched = tmp_path / "runc.conf"
    watched.write_text("")
    with pytest.raises(RuntimeError, match="dump failed"), freeze_when_opened(watched, cg):
        watched.read_text()
        wait_for(lambda: frozen(cg), 10, "the cgroup to be frozen")
        raise RuntimeError("dump failed")
    wait_for(lambda: not frozen(cg), 10, "the cgroup to thaw after the failure")


def test_a_freeze_that_criu_finished_and_thawed_before_the_watcher_saw_it_ends_the_wait(
    tmp_path: Path, sleeper, monkeypatch
) -> None:
    """CRIU can see the freeze half done, seize the tasks and thaw the cgroup between two of the
    watcher's looks: the watcher must stop waiting for "frozen 1" then (it once waited out its
    1 s limit, and the dump's caller waited for it)."""
    from podmigrate.runtime import freezer

    _, cg = sleeper
    watched = tmp_path / "runc.conf"
    watched.write_text("")
    monkeypatch.setattr(freezer, "frozen", lambda cgroup: False)  # the moment it was frozen is missed
    with freeze_when_opened(watched, cg) as watcher:
        assert watcher is not None
        watched.read_text()
        wait_for(lambda: "frozen_by_us_at" in watcher.times, 10, "the watcher to freeze the cgroup")
        (cg / "cgroup.freeze").write_text("0")  # what CRIU does once it holds the tasks
        wait_for(lambda: "thawed_by_criu_at" in watcher.times, 10, "the watcher to see the thaw")
    assert "frozen_at" not in watcher.times
    assert (cg / "cgroup.freeze").read_text().strip() == "0"  # and it did not freeze it again
