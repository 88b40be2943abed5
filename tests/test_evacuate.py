"""``podmigrate evacuate`` against the fake lab (``tests/fake_lab.py``): the real controller and
runner move each workload; the target that fails, the cordon, the record (no root, no CRIU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from podmigrate.engine import controller
from podmigrate.engine.controller import Plan, migrate
from podmigrate.engine.evacuate import Evacuation, dry_run
from podmigrate.errors import UsageError
from podmigrate.lab import cordon
from tests.fake_lab import FakeLab, World


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeLab:
    # a fake agent does not restart: no waiting for one to come back before an undo is retried
    monkeypatch.setattr(controller.LabRunner, "patience", 0.0)
    monkeypatch.setattr(controller.LabRunner, "artifact_patience", 0.0)
    lab = FakeLab(tmp_path, World(("node-a", "node-b", "node-c")))
    for name in ("w1", "w2", "w3"):
        lab.world.start("node-a", name)
    lab.world.start("node-b", "stays")  # another node's workload is left alone
    return lab


def heaps(lab: FakeLab) -> dict[str, str]:
    return {c.name: c.heap for n in lab.world.nodes.values() for c in n.containers.values() if c.serves()}


def test_an_evacuation_moves_every_workload_off_the_node_cordons_it_and_keeps_a_record(lab: FakeLab) -> None:
    before = heaps(lab)
    rec = Evacuation(lab, "node-a", deadline_s=120).run()
    assert rec["empty"] and rec["met_deadline"] and rec["left_running"] == []
    assert {w["workload"]: w["status"] for w in rec["workloads"]} == {"w1": "moved", "w2": "moved", "w3": "moved"}
    assert all(w["state"] == "kept" and w["target"] in ("node-b", "node-c") for w in rec["workloads"])
    assert heaps(lab) == before  # every heap, once, somewhere else
    assert not [c for c in lab.world.nodes["node-a"].containers.values() if c.serves()]
    assert cordon.cordoned(lab) == {"node-a"}
    saved = json.loads((lab.dir / "evacuations" / f"{rec['id']}.json").read_text())
    assert saved["plan"]["fits"] and len(saved["plan"]["steps"]) == 3 and saved["failed_targets"] == {}
    with pytest.raises(UsageError, match="node-a is cordoned"):
        migrate(lab, Plan("stays", "node-a", "stop-copy", "stream"))  # nothing lands there again


def test_a_target_that_fails_takes_no_more_workloads_and_the_rest_is_planned_on_the_others(lab: FakeLab) -> None:
    before = heaps(lab)
    lab.world.fail("node-b", "POST", r"^/v1/checkpoints/[^/]+/restore(-lazy)?$", message="disk on fire", times=99)
    rec = Evacuation(lab, "node-a", deadline_s=120).run()
    assert rec["empty"], rec
    assert "node-b" in rec["failed_targets"] and "disk on fire" in rec["failed_targets"]["node-b"]
    assert {w["target"] for w in rec["workloads"]} == {"node-c"}
    assert all(w["status"] == "moved" and w["state"] == "kept" for w in rec["workloads"])
    assert rec["replans"] and rec["replans"][0]["why"] == "node-b failed"
    assert heaps(lab) == before
    retried = [w for w in rec["workloads"] if w["attempts"] == 2]
    assert len(retried) == 1  # the one that hit node-b rolled back and moved again


def test_a_workload_whose_every_target_fails_is_reported_with_the_reason_and_still_serves(lab: FakeLab) -> None:
    for n in ("node-b", "node-c"):
        lab.world.fail(n, "POST", r"^/v1/checkpoints/[^/]+/restore(-lazy)?$", message=f"{n} broke", times=99)
    before = heaps(lab)
    rec = Evacuation(lab, "node-a", deadline_s=120).run()
    assert not rec["empty"] and not rec["met_deadline"]
    assert set(rec["failed_targets"]) == {"node-b", "node-c"}
    assert all(w["status"] == "lost" for w in rec["workloads"]), rec["workloads"]
    assert all("no target has" in w["why"] for w in rec["workloads"])
    assert heaps(lab) == before  # rolled back: each still serves on node-a, nothing lost silently
    assert sorted(rec["left_running"]) == ["w1", "w2", "w3"]


def test_a_dry_run_plans_with_predicted_times_and_changes_nothing(lab: FakeLab) -> None:
    out = dry_run(Evacuation(lab, "node-a", deadline_s=30))
    assert out["plan"]["fits"] and all(s["end_s"] <= 30 for s in out["plan"]["steps"])
    assert all(b.startswith("default") for b in out["rates"].values())  # no past migration yet
    assert cordon.cordoned(lab) == set() and not list((lab.dir / "evacuations").glob("ev-*.json"))
    assert heaps(lab)["w1"] and lab.world.where("w1")[0][0] == "node-a"


def test_bad_requests_are_refused_before_anything_changes(lab: FakeLab) -> None:
    with pytest.raises(UsageError, match="deadline must be in the future"):
        Evacuation(lab, "node-a", deadline_s=0)
    with pytest.raises(UsageError, match="no such node"):
        Evacuation(lab, "node-a", to=["node-z"])
    with pytest.raises(UsageError, match="the node being emptied"):
        Evacuation(lab, "node-a", to=["node-a"])
    with pytest.raises(UsageError, match="no node 'node-q'"):
        dry_run(Evacuation(lab, "node-q"))
    assert cordon.cordoned(lab) == set()
