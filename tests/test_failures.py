"""Injected failures at each phase end with the workload serving on exactly one node, its heap
intact, and nothing left behind (real lab). Faults are injected between phases through the
controller's progress callback, which sees "✓ <phase>" as each phase completes."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import MigrationFailed, UsageError
from podmigrate.workload import manage

from .conftest import wait_for
from .test_migration import assert_clean

pytestmark = pytest.mark.lab


def after(phase: str, action: Callable[[], None]) -> Callable[[str], None]:
    def report(msg: str) -> None:
        if msg.startswith(f"✓ {phase} "):
            action()

    return report


def fails_and_rolls_back(
    lab: Any, st: dict[str, Any], phase: str, report: Callable[[str], None], **plan: Any
) -> dict[str, Any]:
    with pytest.raises(MigrationFailed, match=f"(?s)failed in phase {phase}.*rolled back") as exc:
        migrate(lab, Plan(workload=st["name"], target="node-b", **plan), report)
    rec: dict[str, Any] = exc.value.details["record"]
    assert rec["status"] == "rolled_back", rec["rollbacks"]
    now = manage.state(lab, st["name"])
    assert now["node"] == "node-a" and now["sha256"] == st["sha256"] and now["started"] == st["started"]
    assert now["counter"] >= st["counter"]
    assert lab.agent("lan").get(f"/v1/routes/{st['ip']}")["via"] == layout.node_ip("node-a")
    assert_clean(lab, st["name"])
    return rec


def test_a_tampered_checkpoint_image_is_refused_before_restore(lab, workload):
    st = workload(heap_mb=16)
    seen: dict[str, Any] = {}

    def tamper() -> None:
        blob = max(
            (p for p in (lab.dir / "registry").rglob("data") if p.stat().st_size > 16 << 20),
            key=lambda p: p.stat().st_mtime,
        )
        with open(blob, "r+b") as f:
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0xFF]))
        seen["blob"] = blob

    rec = fails_and_rolls_back(lab, st, "pull", after("push", tamper), transport="registry")
    assert "refusing to restore" in rec["error"]["message"]
    assert seen["blob"].parent.name in rec["checkpoint_image"]["layer_digest"]


@pytest.mark.parametrize(("transport", "moved_by"), [("registry", "pull"), ("stream", "transfer")])
def test_a_restore_that_fails_rolls_back_to_the_source(lab, workload, transport, moved_by):
    st = workload(heap_mb=16)

    def break_archive() -> None:
        files = [f for f in lab.agent("node-b").get("/v1/checkpoints") if f["file"].endswith(".tar")]
        archive = Path(lab.dir / "nodes" / "node-b" / "checkpoints" / files[0]["file"])
        archive.write_bytes(b"this is not a checkpoint archive")

    rec = fails_and_rolls_back(lab, st, "restore", after(moved_by, break_archive), transport=transport)
    assert rec["error"]["kind"] == "RuntimeBackendError"
    if transport == "stream":  # the source was kept frozen, not killed: it was woken up
        undone = {r["phase"]: r for r in rec["rollbacks"]}
        # and CRIU's network lock, an nft table CRIU-<run> in the container's netns (lab.image), removed
        assert "resumed" in undone["checkpoint"]["did"] and "'CRIU-" in undone["checkpoint"]["did"]


def test_a_cut_lan_link_during_transfer_rolls_back(lab, workload):
    st = workload(heap_mb=16)

    def cut() -> None:
        lab.run("lan", ["ip", "link", "set", "vnode-b", "down"])

    try:
        fails_and_rolls_back(lab, st, "pull", after("push", cut), transport="registry")
    finally:
        lab.run("lan", ["ip", "link", "set", "vnode-b", "up"])


def test_a_full_target_disk_is_refused_before_the_freeze_and_one_that_fills_up_rolls_back(lab, workload):
    st = workload(heap_mb=32)
    lab.run("node-b", ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", layout.NODE_CHECKPOINTS])
    try:  # too small from the start: validate says so, nothing is frozen, no record
        with pytest.raises(UsageError, match="node-b has 4 MiB of disk free; this checkpoint needs about"):
            migrate(lab, Plan(workload=st["name"], target="node-b", transport="stream"))
        now = manage.state(lab, st["name"])
        assert now["node"] == "node-a" and now["started"] == st["started"]
    finally:
        lab.run("node-b", ["umount", layout.NODE_CHECKPOINTS])
    lab.run("node-b", ["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", layout.NODE_CHECKPOINTS])
    try:  # room at validate, gone by the dump (another writer filled the disk): the dump fails, rolled back
        filler = f"{layout.NODE_CHECKPOINTS}/filler"

        def report(msg: str) -> None:
            if msg.startswith("✓ validate "):
                lab.run("node-b", ["fallocate", "-l", "1020M", filler])
            elif msg.startswith("✗ checkpoint"):  # the other writer goes away; the rollback must clean up
                lab.run("node-b", ["rm", "-f", filler])

        rec = fails_and_rolls_back(lab, st, "checkpoint", report, transport="stream")
        assert rec["error"]["kind"] == "RuntimeBackendError"
    finally:
        lab.run("node-b", ["umount", layout.NODE_CHECKPOINTS])


def test_a_target_agent_killed_before_restore_rolls_back_once_it_is_back(lab, workload):
    st = workload(heap_mb=16)
    hold = lab.dir / "hold" / "node-b"

    def kill_agent() -> None:
        hold.touch()
        lab.kill_service("node-b", signal.SIGKILL)
        # the lab brings it back a little later, as it would after a crash
        threading.Timer(3.0, lambda: hold.unlink(missing_ok=True)).start()

    try:
        rec = fails_and_rolls_back(lab, st, "restore", after("pull", kill_agent), transport="registry")
        assert rec["error"]["kind"] == "AgentError"
    finally:
        hold.unlink(missing_ok=True)
        wait_for(lambda: (lab.dir / "agents" / "node-b.sock").exists(), 30, "node-b agent back")


@pytest.mark.parametrize("plan", [{"mode": "lazy"}, {"mode": "stop-copy", "transport": "stream"}])
def test_a_dump_that_fails_cancels_the_restore_waiting_for_it_on_the_target(lab, workload, plan):
    """The target's podman had done its part of the restore before the freeze (runtime.speculative)
    and waited at runc's gate: the failed dump's rollback makes it give up, and removes what it made."""
    st = workload(heap_mb=16)
    conf = lab.dir / "nodes" / "node-a" / "criu-etc" / "runc.conf.default"
    good = conf.read_text()

    def break_criu() -> None:  # every CRIU on node-a from now on refuses its configuration
        conf.write_text(good + "no-such-criu-option\n")

    try:
        rec = fails_and_rolls_back(lab, st, "checkpoint", after("validate", break_criu), **plan)
    finally:
        conf.write_text(good)
    assert rec["speculative"]["state"] == "cancelled", rec["speculative"]
    assert not [c for c in lab.agent("node-b").get("/v1/containers") if c["name"] == st["name"]]
    # and in podman's storage, and runc-gate's FIFO
    left = lab.run("node-b", ["sh", "-c", "podman ps -a --storage --format '{{.Names}}'; ls /run/podmigrate/gates"])
    assert st["name"] not in left.stdout.split() and ".fifo" not in left.stdout, left.stdout


def test_a_failed_lazy_restore_makes_the_source_give_up_its_dump_and_serve_again(lab, workload):
    st = workload(heap_mb=16)

    def break_archive() -> None:
        files = [f for f in lab.agent("node-b").get("/v1/checkpoints") if f["file"].endswith(".tar")]
        (lab.dir / "nodes" / "node-b" / "checkpoints" / files[0]["file"]).write_bytes(b"not a checkpoint")

    rec = fails_and_rolls_back(lab, st, "restore", after("transfer", break_archive), mode="lazy")
    undone = {r["phase"]: r for r in rec["rollbacks"]}
    assert "gave up" in undone["checkpoint"]["did"]
