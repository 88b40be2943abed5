"""``podmigrate lab notice`` and ``watch`` in a real lab: a Spot notice turned into an evacuation
that keeps every heap, and the deadline that stops what is still there."""

from __future__ import annotations

from typing import Any

import pytest

from podmigrate import cordon
from podmigrate.engine import watch
from podmigrate.lab import notice
from podmigrate.workload import manage

from .conftest import wait_for

pytestmark = pytest.mark.lab


def test_a_spot_notice_empties_the_node_by_its_deadline_with_every_state_kept(lab: Any, workload: Any) -> None:

    started = [workload("node-a", 64), workload("node-a", 16, sidecar=True)]
    before = {s["name"]: manage.state(lab, s["name"]) for s in started}
    try:
        notice.post(lab, "node-a", 40)
        (rec,) = watch.watch(lab, nodes=["node-a"], once=True)
        assert rec["empty"] and rec["met_deadline"], rec
        assert {w["status"] for w in rec["workloads"]} == {"moved"} and rec["state_kept"] == 2
        assert {w["kind"] for w in rec["workloads"]} == {"container", "pod"}
        for name, b in before.items():
            after = manage.state(lab, name)
            assert after["node"] == "node-b" and after["sha256"] == b["sha256"] and after["started"] == b["started"]
        assert watch.pending(lab, ["node-a"]) == {}  # handled once
        gone = wait_for(lambda: notice.terminated(lab, "node-a"), 60, "the node's deadline")
        assert gone["stopped"] == [] and gone["failed"] == {}  # nothing was left for the deadline to stop
    finally:
        notice.withdraw(lab, "node-a")
        cordon.uncordon(lab, "node-a")


def test_at_the_deadline_what_is_still_on_the_node_is_stopped_and_reported(lab: Any, workload: Any) -> None:

    w = workload("node-a", 16)
    try:
        posted = notice.post(lab, "node-a", 2)
        assert watch.notices(lab)["node-a"]["time"] == posted["instance_action"]["time"]
        gone = wait_for(lambda: notice.terminated(lab, "node-a"), 60, "the node's deadline")
        assert w["name"] in gone["stopped"] and w["ip"] in gone["routes_removed"]
        states = {c["name"]: c["state"] for c in manage.inventory(lab)["node-a"]}
        assert states[w["name"]] != "running"
        lan = lab.agent("lan")
        try:
            routed = {r["dst"] for r in lan.get("/v1/routes")}
        finally:
            lan.close()
        assert w["ip"] not in routed
    finally:
        notice.withdraw(lab, "node-a")
    assert "node-a" not in watch.notices(lab)
