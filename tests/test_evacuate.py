"""``podmigrate evacuate`` against the fake lab (``tests/fake_lab.py``): the real controller and
runner move each workload; the target that fails, the cordon, the record (no root, no CRIU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from podmigrate import cordon
from podmigrate.engine import controller
from podmigrate.engine.controller import Plan, migrate
from podmigrate.engine.evacuate import Evacuation, collapsed, dry_run
from podmigrate.engine.schedule import GB
from podmigrate.errors import UsageError
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


def test_lazy_copies_get_their_huge_pages_back_once_the_node_is_empty(lab: FakeLab) -> None:
    rec = Evacuation(lab, "node-a", deadline_s=120).run()
    moved = [w for w in rec["workloads"] if w["mode"] == "lazy"]
    assert moved, rec["workloads"]  # the plan's way with this lab's default rates
    store = controller.store_for(lab)
    for w in moved:  # nothing collapsed while other migrations needed the CPU
        assert (store.get(w["migration"]) or {}).get("huge_pages") == {"state": "deferred"}
    asked = {(e["target"], e["container"]): e["state"] for e in rec["huge_pages"]}
    assert asked == {(w["target"], w["workload"]): "collapsing" for w in moved}
    assert [e["state"] for e in collapsed(lab, rec)] == ["done"] * len(moved)
    # a single migration still collapses at its end, in the target agent's background
    one = migrate(lab, Plan("stays", "node-c", "lazy", "stream"))
    assert one["huge_pages"]["state"] == "collapsing"
    with pytest.raises(UsageError, match="huge pages are collapsed after or deferred"):
        migrate(lab, Plan("stays", "node-b", "lazy", "stream", huge_pages="never"))


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


def test_a_workload_whose_every_target_fails_is_parked_or_else_reported_with_the_reason(lab: FakeLab) -> None:
    from podmigrate.engine import parking

    for n in ("node-b", "node-c"):
        lab.world.fail(n, "POST", r"^/v1/checkpoints/[^/]+/restore(-lazy)?$", message=f"{n} broke", times=99)
    lab.world.fail("node-a", "POST", r"^/v1/checkpoints/[^/]+/push$", message="registry full", times=1)
    before = heaps(lab)
    rec = Evacuation(lab, "node-a", deadline_s=120).run()
    assert set(rec["failed_targets"]) == {"node-b", "node-c"}
    by = {w["workload"]: w for w in rec["workloads"]}
    parked = sorted(n for n, w in by.items() if w["status"] == "parked")
    (failed,) = [w for w in by.values() if w["status"] != "parked"]  # the one whose push failed
    assert len(parked) == 2 and all("no target has" in by[n]["why"] for n in parked)
    assert failed["status"] == "failed" and failed["why"].startswith("parking it failed: migration ")
    assert "failed in phase push: registry full; rolled back, it runs on node-a" in failed["why"]
    assert not rec["empty"] and not rec["met_deadline"] and rec["left_running"] == [failed["workload"]]
    # nothing lost silently: two in the registry, the third rolled back and serving where it was
    assert sorted(e["workload"] for e in parking.listing(lab)) == parked
    assert heaps(lab) == {failed["workload"]: before[failed["workload"]], "stays": before["stays"]}


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


def test_how_much_slower_two_at_once_are_is_learned_per_mode_from_past_evacuations(lab: FakeLab) -> None:
    from podmigrate.engine.rates import learn
    from podmigrate.engine.survey import records_dir, slowdowns

    rates = learn([])  # the defaults: what the ratios are taken against
    mb = 256 << 20

    def rec(k: int, mode: str, transport: str, took: list[float]) -> dict[str, object]:
        ws = [{"status": "moved", "mode": mode, "transport": transport, "memory": mb, "took_s": t} for t in took]
        return {"parallel": k, "workloads": ws}

    alone_sc = rates["stop-copy/stream"].total(mb)
    alone_lazy = rates["lazy/stream"].total(mb)
    past = [
        rec(1, "stop-copy", "stream", [alone_sc] * 2),
        rec(2, "stop-copy", "stream", [2 * alone_sc] * 2),
        rec(1, "lazy", "stream", [alone_lazy] * 2),
        rec(2, "lazy", "stream", [1.2 * alone_lazy] * 3),
    ]
    for i, r in enumerate(past):
        (records_dir(lab) / f"ev-{i}.json").write_text(json.dumps(r))
    factors, basis = slowdowns(lab, rates)
    assert factors[1] == 1.0
    assert factors[2] == {"*": 1.5, "stop-copy": pytest.approx(2.0), "lazy": pytest.approx(1.2)}
    assert basis.startswith("measured:") and "stop-copy 2 at once 2.0x (2 vs 2 alone)" in basis


def test_the_evacuation_benchmark_reads_its_workload_set_and_tabulates_runs(tmp_path: Path) -> None:
    from podmigrate.bench.evacuate import markdown, parse_set, table

    assert [(mb, pod) for _, mb, pod in parse_set("2x256,1x1024,pod64")] == [(256, False)] * 2 + [
        (1024, False),
        (64, True),
    ]
    with pytest.raises(Exception, match="not a workload set entry"):
        parse_set("lots")
    w = {"memory": GB, "mode": "lazy", "transport": "stream", "blackout_s": 0.4}
    runs = (("planned", 12.0, True), ("planned", 20.0, True), ("sequential", 40.0, False))

    def rec(t: float) -> dict[str, object]:
        return {"empty": True, "time_to_empty_s": t, "parallel": 1, "workloads": [w]}

    rows = [{"variant": v, "kept": {"a": ok}, "record": rec(t)} for v, t, ok in runs]
    tab = table(rows)
    assert tab["planned"]["time_to_empty_s"] == {"median": 16.0, "min": 12.0, "max": 20.0}
    assert tab["planned"]["met"] == {"120": 2, "30": 2, "15": 1} and tab["sequential"]["state_kept"] == "0/1 runs"
    md = markdown({"workloads": "x", "resident_bytes": GB, "runs": 2, "deadline_s": 120, "when": "now",
                   "variants": tab, "study_1gb_s": 36.8})  # fmt: skip
    assert (
        "| planned | 1 | lazy/stream | 2/2 | 16.0 s (12.0-20.0) | 0.400 s | 2/2 runs | 2 / 2 / 1 of 2 | 2 / 0 / 0 / 0 |"
        in md
    )


def test_a_workload_no_target_can_hold_is_parked_and_restored_later_with_its_heap(lab: FakeLab) -> None:
    from podmigrate.engine import parking
    from podmigrate.engine.controller import restore

    before = heaps(lab)
    for n in ("node-b", "node-c"):  # room for none of the three
        lab.world.nodes[n].facts["mem_available_bytes"] = 200 << 20
    rec = Evacuation(lab, "node-a", deadline_s=120).run()
    assert {w["status"] for w in rec["workloads"]} == {"parked"}, rec["workloads"]
    assert all("restorable later" in w["why"] and "podmigrate restore" in w["why"] for w in rec["workloads"])
    assert rec["empty"] and sorted(rec["parked"]) == ["w1", "w2", "w3"]
    assert [s["action"] for s in rec["plan"]["steps"]] == ["park"] * 3
    assert not [c for c in lab.world.nodes["node-a"].containers.values() if c.serves()]
    assert sorted(e["workload"] for e in parking.listing(lab)) == ["w1", "w2", "w3"]
    lab.world.nodes["node-c"].facts.pop("mem_available_bytes")
    for name in ("w1", "w2", "w3"):
        assert restore(lab, name, "node-c")["state"] == "kept"
    assert heaps(lab) == before and parking.listing(lab) == []
    assert lab.world.registry == {}  # each image went with its restore


def test_what_the_plan_gave_up_on_is_tried_again_with_the_time_left(lab: FakeLab) -> None:
    """The plan (default rates) moves two of three in 4 s and gives up on the third; the fake lab's
    moves take milliseconds, so the third is planned again with the time left, and moves."""
    before = heaps(lab)
    rec = Evacuation(lab, "node-a", deadline_s=4.0).run()
    first = {s["workload"]: s["action"] for s in rec["plan"]["steps"]}
    assert sorted(first.values()) == ["lost", "migrate", "migrate"]
    assert rec["empty"] and rec["met_deadline"], rec
    assert all(w["status"] == "moved" and w["state"] == "kept" for w in rec["workloads"])
    assert [r["why"] for r in rec["replans"]] == ["planned as lost: tried again with the time left"]
    assert heaps(lab) == before


def test_what_is_still_lost_when_tried_again_is_reported_once_and_stays_where_it_runs(lab: FakeLab) -> None:
    rec = Evacuation(lab, "node-a", deadline_s=2.0).run()
    by = {w["workload"]: w for w in rec["workloads"]}
    assert [s["action"] for s in rec["plan"]["steps"]].count("lost") == 2
    assert len(rec["replans"]) == 1  # tried again once, not over and over
    lost = [w for w in by.values() if w["status"] == "lost"]
    assert lost and all("no way of moving it ends before the deadline" in w["why"] for w in lost)
    assert sorted(rec["left_running"]) == sorted(w["workload"] for w in lost)
    assert not rec["empty"] and not rec["met_deadline"]


def test_a_pod_is_never_planned_for_a_cold_restart() -> None:
    from podmigrate.engine.schedule import Rate, Target, Workload, plan

    cold = Rate("cold", "none", 0.5, 100 * GB, 0.3, None, "test")
    archive = Rate("stop-copy", "archive", 20.0, 0.1 * GB, 0.8, 0.1 * GB, "test")
    ws = [Workload("pod-server", 64 << 20, "pod", "pod"), Workload("c", 64 << 20)]
    rates = {"stop-copy/archive": archive, "lazy/stream": Rate("lazy", "stream", 20.0, GB, 0.4, None, "test")}
    p = plan(ws, [Target("node-b", 20 * GB, 50 * GB)], rates, 5.0, cold=cold)
    by = {s.workload: s for s in p.steps}
    assert by["c"].action == "restart"  # a container is, when nothing else ends in time
    assert by["pod-server"].action == "lost"  # the engine moves pods by stop-copy or decoupled only
