"""The engine's phases, rollbacks and crash recovery against the fake lab (``tests/fake_lab.py``):
no root, no CRIU, milliseconds per migration. The real lab tests prove the same paths end to end."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.engine import controller, phases, plans
from podmigrate.engine.controller import Plan, migrate, recover, store_for
from podmigrate.errors import MigrationFailed, UsageError
from tests.fake_lab import CAPABILITIES, ControllerDied, FakeLab

# (mode, transport) of every lab container row of the plan table that moves it to another node
ROWS = [(m, t) for (s, m, t) in plans.PLANS if s == "container" and m != "park"]
# the agent call each phase makes first: where a fault in that phase is injected (after letting
# pass the calls to it that earlier phases make: validate reads the workload's state once)
CALLS: dict[str, tuple[str, str, str, int]] = {
    "page-server": ("target", "POST", r"/page-server$", 0),
    "checkpoint": ("source", "POST", r"^/v1/containers/[^/]+/checkpoint(-lazy)?$", 0),
    "push": ("source", "POST", r"/push$", 0),
    "pull": ("target", "POST", r"/pull$", 0),
    "transfer": ("source", "POST", r"/send$", 0),
    "restore": ("target", "POST", r"^/v1/checkpoints/[^/]+/restore(-lazy)?$", 0),
    "stop": ("source", "POST", r"/stop$", 0),
    "start": ("target", "POST", r"^/v1/containers$", 0),
    "cutover": ("lan", "PUT", r"^/v1/routes/", 0),
    "verify": ("lan", "POST", r"^/v1/http$", 1),
    "pages": ("target", "GET", r"/lazy$", 0),
}


@pytest.fixture(autouse=True)
def no_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    # the lab retries an undo for a minute while its agent restarts; a fake agent does not restart
    monkeypatch.setattr(controller.LabRunner, "patience", 0.0)
    monkeypatch.setattr(controller.LabRunner, "artifact_patience", 0.0)


@pytest.fixture
def lab(tmp_path: Path) -> FakeLab:
    return FakeLab(tmp_path)


def started(lab: FakeLab) -> dict[str, Any]:
    c = lab.world.start("node-a", "web")
    c.counter = 41
    return {"ip": c.ip, "heap": c.heap, "started": c.started, "counter": c.counter}


# which agent a role names in these tests (node-a is always the source)
AGENT = {"source": "node-a", "target": "node-b", "lan": "lan"}


def assert_serves_on(lab: FakeLab, node: str, before: dict[str, Any], same_process: bool = True) -> None:
    """The workload answers at its address from ``node`` alone, with its heap (and its process)."""
    found = lab.world.serving(before["ip"])
    assert found is not None, "nothing answers at the service address"
    where, c = found
    assert where == node and c.heap == before["heap"]
    if same_process:
        assert c.started == before["started"] and c.counter >= before["counter"]
    assert [n for n, x in lab.world.where("web") if x.serves()] == [node]
    assert lab.world.routes[before["ip"]] == layout.node_ip(node)


def assert_nothing_left(lab: FakeLab) -> None:
    left = lab.world.leftovers()
    assert left == {"archives": {}, "images": [], "stopped": [], "reserved": {}, "lazy": {}, "probes": []}, left


@pytest.mark.parametrize(("mode", "transport"), ROWS)
def test_every_row_of_the_plan_table_runs_its_phases_and_moves_the_workload(lab, mode, transport):
    before = started(lab)
    rec = migrate(lab, Plan(workload="web", target="node-b", mode=mode, transport=transport))
    assert rec["status"] == "completed"
    assert [p["name"] for p in rec["phases"]] == [p.value for p in plans.row("container", mode, transport).phases]
    assert rec["state"] == ("lost" if mode == "cold" else "kept")
    assert_serves_on(lab, "node-b", before, same_process=mode != "cold")
    assert_nothing_left(lab)
    assert store_for(lab).get(rec["id"])["status"] == "completed"  # type: ignore[index]


FAILURES = [
    (mode, transport, phase.value)
    for (scope, mode, transport), row in plans.PLANS.items()
    if scope == "container"
    for phase in row.phases[1 : row.phases.index(row.commit) + 1]
    if phase.value in CALLS
]


@pytest.mark.parametrize(("mode", "transport", "phase"), FAILURES)
def test_a_failure_in_any_phase_before_the_commit_rolls_back_to_the_source(lab, mode, transport, phase):
    before = started(lab)
    role, method, path, skip = CALLS[phase]
    lab.world.fail(AGENT[role], method, path, message=f"{phase} broke", skip=skip)
    with pytest.raises(
        MigrationFailed, match=f"failed in phase {phase}: {phase} broke; rolled back, it runs on node-a"
    ):
        migrate(lab, Plan(workload="web", target="node-b", mode=mode, transport=transport))
    (rec,) = store_for(lab).list()
    assert rec["status"] == "rolled_back" and rec["error"]["message"] == f"{phase} broke"
    undone = [r["phase"] for r in rec["rollbacks"]]
    with_undo = {p.name.value for p in phases.implementations("container", mode).values() if p.undo}
    assert undone == [p["name"] for p in reversed(rec["phases"]) if p["name"] in with_undo]
    assert all(r["ok"] for r in rec["rollbacks"])
    assert_serves_on(lab, "node-a", before, same_process=mode != "cold")
    assert_nothing_left(lab)


DEATHS = [
    (mode, transport, phase.value, row.phases.index(phase) > row.phases.index(row.commit))
    for (scope, mode, transport), row in plans.PLANS.items()
    if scope == "container"
    for phase in row.phases[1:]
    if phase.value in CALLS
]


@pytest.mark.parametrize(("mode", "transport", "phase", "past_commit"), DEATHS)
def test_a_controller_that_dies_in_any_phase_is_rolled_back_or_finished_by_the_next(
    lab, mode, transport, phase, past_commit
):
    before = started(lab)
    role, method, path, skip = CALLS[phase]
    lab.world.fail(AGENT[role], method, path, kind="die", skip=skip)
    with pytest.raises(ControllerDied):
        migrate(lab, Plan(workload="web", target="node-b", mode=mode, transport=transport))
    (left,) = store_for(lab).active()
    assert left["phase"] == phase
    (rec,) = recover(lab, store_for(lab))
    if past_commit:  # the target holds the only complete copy: finished forward
        assert rec["status"] == "completed", rec
        assert_serves_on(lab, "node-b", before, same_process=mode != "cold")
    else:
        assert rec["status"] == "rolled_back", rec
        assert_serves_on(lab, "node-a", before, same_process=mode != "cold")
    assert_nothing_left(lab)
    assert store_for(lab).active() == []


def test_a_controller_that_dies_during_the_rollback_leaves_it_for_the_next_to_finish(lab):
    before = started(lab)
    lab.world.fail("node-b", "POST", r"/restore$", message="restore broke")
    lab.world.fail("node-a", "POST", r"^/v1/registry/delete$", kind="die")  # in the undo of push
    with pytest.raises(ControllerDied):
        migrate(lab, Plan(workload="web", target="node-b", transport="registry"))
    (left,) = store_for(lab).active()
    assert left["status"] == "rolling_back" and [r["phase"] for r in left["rollbacks"]] == ["restore", "pull"]
    calls = len(lab.world.calls)
    (rec,) = recover(lab, store_for(lab))
    assert rec["status"] == "rolled_back"
    assert [r["phase"] for r in rec["rollbacks"]] == ["restore", "pull", "push", "checkpoint"]
    # the undos that had succeeded (restore, pull: both on the target) are not run again
    assert [path for node, _, path in lab.world.calls[calls:] if node == "node-b"] == [
        f"/v1/checkpoints/{rec['id']}/release-memory"
    ]
    assert_serves_on(lab, "node-a", before)
    assert_nothing_left(lab)


def test_a_cold_rollback_cut_short_after_the_old_container_went_is_finished_by_the_next(lab):
    before = started(lab)
    lab.world.fail("node-b", "POST", r"^/v1/containers$", message="start broke")
    lab.world.fail("node-a", "POST", r"^/v1/containers/web-pm-restarted/rename$", kind="die")
    with pytest.raises(ControllerDied):
        migrate(lab, Plan(workload="web", target="node-b", mode="cold"))
    assert lab.world.where("web") == []  # the old one removed, the fresh one not yet named
    (rec,) = recover(lab, store_for(lab))
    assert rec["status"] == "rolled_back", rec.get("rollbacks")
    assert rec["rollbacks"][-1]["did"].startswith("finished restarting web on node-a"), rec["rollbacks"]
    assert_serves_on(lab, "node-a", before, same_process=False)
    assert_nothing_left(lab)


def test_an_undo_that_only_deletes_a_copy_and_fails_leaves_a_leftover_not_a_failure(lab):
    before = started(lab)
    lab.world.fail("node-b", "POST", r"/restore$", message="restore broke")
    lab.world.fail("node-a", "POST", r"^/v1/registry/delete$", message="registry down", times=2)
    with pytest.raises(MigrationFailed, match="rolled back"):
        migrate(lab, Plan(workload="web", target="node-b", transport="registry"))
    (rec,) = store_for(lab).list()
    assert rec["status"] == "rolled_back"
    assert rec["leftovers"] == [{"phase": "push", "error": "registry down"}]  # tried again after the rest
    assert_serves_on(lab, "node-a", before)
    assert list(lab.world.registry) == [rec["reference"]]  # what gc will find


def test_an_artifact_undo_that_failed_is_tried_again_once_the_workload_is_safe(lab, monkeypatch):
    monkeypatch.setattr(controller.LabRunner, "artifact_patience", 30.0)
    monkeypatch.setattr(controller.LabRunner, "retry_delay", 0.01)
    before = started(lab)
    lab.world.fail("node-b", "POST", r"/restore$", message="restore broke")
    # the target's agent is restarting: its archive cannot be deleted at first
    lab.world.fail("node-b", "DELETE", r"^/v1/checkpoints/", kind="unreachable", message="refused", times=3)
    with pytest.raises(MigrationFailed, match="rolled back"):
        migrate(lab, Plan(workload="web", target="node-b", transport="registry"))
    (rec,) = store_for(lab).list()
    assert rec["status"] == "rolled_back" and "leftovers" not in rec
    undos = [r["phase"] for r in rec["rollbacks"]]
    assert undos.index("checkpoint") < len(undos) - 1 - undos[::-1].index("pull")  # the retry came after the source
    assert_serves_on(lab, "node-a", before)
    assert_nothing_left(lab)


def test_an_undo_that_protects_the_workload_and_fails_makes_the_migration_failed(lab):
    started(lab)
    lab.world.fail("node-b", "POST", r"/restore$", message="restore broke")
    lab.world.fail("node-a", "POST", r"^/v1/containers/web/restore$", message="restore in place broke")
    with pytest.raises(MigrationFailed, match="ROLLBACK FAILED: see the record"):
        migrate(lab, Plan(workload="web", target="node-b", transport="registry"))
    (rec,) = store_for(lab).list()
    assert rec["status"] == "failed"
    assert [r["ok"] for r in rec["rollbacks"]] == [True, True, True, False]


def test_an_unreachable_agent_during_an_undo_is_retried_while_it_comes_back(lab, monkeypatch):
    before = started(lab)
    monkeypatch.setattr(controller.LabRunner, "patience", 30.0)
    monkeypatch.setattr(controller.LabRunner, "retry_delay", 0.0)
    lab.world.fail("node-b", "POST", r"/restore$", message="restore broke")
    lab.world.fail("node-a", "GET", r"^/v1/containers$", kind="unreachable", times=2, skip=1)  # not validate's
    reports: list[str] = []
    with pytest.raises(MigrationFailed, match="rolled back"):
        migrate(lab, Plan(workload="web", target="node-b"), reports.append)
    assert sum("retrying" in r for r in reports) == 2
    assert_serves_on(lab, "node-a", before)


def test_a_lazy_migration_that_fails_after_its_copy_runs_is_not_rolled_back(lab):
    before = started(lab)
    lab.world.fail("lan", "POST", r"^/v1/http$", message="no answer", skip=1)
    with pytest.raises(MigrationFailed, match="failed in phase verify"):
        migrate(lab, Plan(workload="web", target="node-b", mode="lazy"))
    (rec,) = store_for(lab).list()
    assert rec["status"] == "failed" and rec["rollbacks"] == [] and "only one" in rec["hint"]
    assert_serves_on(lab, "node-b", before)


def test_a_lazy_migration_to_a_node_without_userfaultfd_is_refused_before_anything_changes(lab, monkeypatch):
    started(lab)
    monkeypatch.setitem(CAPABILITIES, "lazy_pages", False)
    with pytest.raises(UsageError, match=r"node-a cannot take part in this migration: .* reports no lazy_pages"):
        migrate(lab, Plan(workload="web", target="node-b", mode="lazy"))
    assert store_for(lab).list() == []  # a rejected request leaves no record
    assert not any("checkpoint" in path for _, _, path in lab.world.calls)


def test_a_request_that_validate_refuses_leaves_no_record_and_changes_nothing(lab):
    before = started(lab)
    with pytest.raises(UsageError, match="already runs on node-a"):
        migrate(lab, Plan(workload="web", target="node-a"))
    with pytest.raises(UsageError, match="no container named 'nope'"):
        migrate(lab, Plan(workload="nope", target="node-b"))
    assert store_for(lab).list() == []
    assert_serves_on(lab, "node-a", before)
    assert not any(m != "GET" for _, m, _ in lab.world.calls)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_during_a_migration_rolls_it_back_at_once(lab, sig):
    before = started(lab)
    lab.world.fail("node-b", "POST", r"/pull$", kind="signal", message=sig)  # mid-migration, source frozen
    with pytest.raises(MigrationFailed, match=f"interrupted by {sig}.*rolled back, it runs on node-a"):
        migrate(lab, Plan(workload="web", target="node-b", transport="registry"))
    (rec,) = store_for(lab).list()
    assert rec["status"] == "rolled_back" and rec["phase"] == "pull"
    assert store_for(lab).active() == []
    assert_serves_on(lab, "node-a", before)
    assert_nothing_left(lab)


def test_a_second_signal_stops_the_rollback_says_what_is_left_and_gc_finishes_it(lab):
    before = started(lab)
    lab.world.fail("node-b", "POST", r"/restore$", message="restore broke")
    # two signals while the rollback deletes the pushed image: the first is only reported
    lab.world.fail("node-a", "POST", r"^/v1/registry/delete$", kind="signal", message="SIGINT,SIGINT")
    said: list[str] = []
    with pytest.raises(MigrationFailed, match="stopped by a second SIGINT; undone so far: restore, pull") as e:
        migrate(lab, Plan(workload="web", target="node-b", transport="registry"), said.append)
    assert "podmigrate gc" in (e.value.hint or "")
    assert any("rolling back migration" in m and "send it again to stop" in m for m in said)
    (left,) = store_for(lab).active()
    assert left["status"] == "rolling_back"
    (rec,) = recover(lab, store_for(lab))
    assert rec["status"] == "rolled_back"
    assert_serves_on(lab, "node-a", before)
    assert_nothing_left(lab)


def test_a_signal_past_the_commit_does_not_interrupt_a_lazy_migration_it_finishes(lab):
    # past the lazy commit (restore) the copy on the target is the only one: cutting the run short
    # would leave it unrouted with its source gone (what the fault matrix found: state lost)
    before = started(lab)
    lab.world.fail("lan", "PUT", r"^/v1/routes/", kind="signal", message="SIGTERM")
    said: list[str] = []
    rec = migrate(lab, Plan(workload="web", target="node-b", mode="lazy"), said.append)
    assert rec["status"] == "completed" and rec["rollbacks"] == []
    assert any("SIGTERM: finishing (past its commit" in m for m in said)
    assert_serves_on(lab, "node-b", before)
    assert_nothing_left(lab)


def test_a_second_signal_past_the_commit_leaves_the_rest_to_gc_which_finishes_forward(lab):
    before = started(lab)
    lab.world.fail("lan", "PUT", r"^/v1/routes/", kind="signal", message="SIGTERM,SIGTERM")
    with pytest.raises(MigrationFailed, match="stopped past its commit by a second SIGTERM") as e:
        migrate(lab, Plan(workload="web", target="node-b", mode="lazy"))
    assert "finishes the migration" in (e.value.hint or "")
    (rec,) = recover(lab, store_for(lab))
    assert rec["status"] == "completed"
    assert_serves_on(lab, "node-b", before)
    assert_nothing_left(lab)


def holder(lab: FakeLab, workload: str) -> Any:
    """Another process that holds a migration claim on ``workload`` until it is killed."""
    import subprocess
    import sys

    code = (
        "import sys, time, pathlib; from podmigrate.claims import Claims; "
        f"Claims(pathlib.Path({str(lab.dir)!r})).take({workload!r}, 'other-mig'); print('held', flush=True); "
        "time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_workload_another_process_migrates_is_refused_and_stop_leaves_it_alone(lab):
    from podmigrate.workload import manage

    before = started(lab)
    p = holder(lab, "web")
    try:
        with pytest.raises(UsageError, match=r"'web' is already being migrated \(other-mig, pid \d+\)"):
            migrate(lab, Plan(workload="web", target="node-b"))
        with pytest.raises(UsageError, match="cannot stop 'web' while a migration runs: web \\(other-mig"):
            manage.stop(lab, "web")
        assert_serves_on(lab, "node-a", before)
    finally:
        p.kill()
        p.wait()
    rec = migrate(lab, Plan(workload="web", target="node-b"))  # a dead holder's claim is free
    assert rec["status"] == "completed"


def test_an_older_runc_on_the_target_is_a_warning_in_the_record_not_a_refusal(lab):
    started(lab)
    lab.world.nodes["node-b"].facts["runc"] = "1.1.5"
    rec = migrate(lab, Plan(workload="web", target="node-b"))
    assert rec["status"] == "completed"
    assert "validate: node-b has runc 1.1.5, older than node-a's 1.3.0" in rec["warnings"]


@pytest.mark.parametrize(
    ("node", "facts", "transport", "message"),
    [
        ("node-b", {"mem_available_bytes": 300 << 20}, "stream", "node-b has 300 MiB of memory available"),
        ("node-b", {"disk_free_bytes": 100 << 20}, "stream", "node-b has 100 MiB of disk free"),
        ("node-a", {"disk_free_bytes": 100 << 20}, "registry", "node-a has 100 MiB of disk free"),
        ("node-b", {"criu": "4.1.0"}, "stream", "node-b has CRIU 4.1.0, older than node-a's 4.2.1"),
        ("node-b", {"cpuinfo": "b2xkZXI="}, "stream", "node-b's CPU cannot run what was dumped on node-a's"),
        ("node-b", {"podman": "4.3.1"}, "stream", "node-b has Podman 4.3.1 and node-a Podman 5.4.2"),
        (
            "node-b",
            {"capabilities": {**CAPABILITIES, "runtime": "containerd"}},
            "stream",
            "node-a runs containers with fake and node-b with containerd",
        ),
    ],
    ids=[
        "target-memory",
        "target-disk",
        "source-disk-for-the-archive",
        "older-criu",
        "other-cpu",
        "podman-major",
        "other-runtime",
    ],
)
def test_a_migration_that_will_not_fit_is_refused_before_anything_is_frozen(lab, node, facts, transport, message):
    before = started(lab)
    lab.world.nodes[node].facts.update(facts)
    if "cpuinfo" in facts:
        lab.world.nodes["node-a"].facts["cpuinfo"] = "bmV3ZXI="  # a newer CPU than node-b's
    if "criu" in facts:  # still >= 4.2 for the node check; older than the source's
        lab.world.nodes["node-a"].facts["criu"] = "4.3.0"
        message = message.replace("4.2.1", "4.3.0").replace("4.1.0", "4.2.1")
        lab.world.nodes[node].facts["criu"] = "4.2.1"
    with pytest.raises(UsageError, match=re.escape(message)):
        migrate(lab, Plan(workload="web", target="node-b", transport=transport))
    assert store_for(lab).list() == []
    assert not [c for c in lab.world.calls if "/checkpoint" in c[2] and c[1] == "POST"]  # nothing dumped
    assert_serves_on(lab, "node-a", before)


@pytest.mark.parametrize("old", [False, True])
def test_the_restored_copy_is_checked_after_its_first_answer_unless_the_old_path_is_asked_for(
    lab: FakeLab, old: bool
) -> None:
    before = started(lab)
    asked = ("restored-check-before-cutover",) if old else ()
    rec = migrate(lab, Plan(workload="web", target="node-b", transport="stream", old_paths=asked))
    assert rec["status"] == "completed"
    assert ("restored_check" in rec) is not old
    assert rec.get("old_paths", []) == list(asked)  # the record says which old path it took
    calls = [(node, method, path) for node, method, path in lab.world.calls]
    listed = calls.index(
        ("node-b", "GET", "/v1/containers"), calls.index(("node-b", "POST", f"/v1/checkpoints/{rec['id']}/restore"))
    )
    switched = next(i for i, c in enumerate(calls) if c[0] == "lan" and c[1] == "PUT")
    assert (listed < switched) is old  # the old path lists the target's containers inside the blackout
    assert_serves_on(lab, "node-b", before)


def test_an_unknown_change_is_refused_with_the_list_of_changes() -> None:
    from podmigrate.engine import paths

    assert paths.parse("restore-image-check,all") == ("restore-image-check", "all")
    with pytest.raises(UsageError, match="no such change: fast") as e:
        paths.parse("fast")
    assert e.value.hint and "restored-check-before-cutover" in e.value.hint


def test_a_parked_workload_is_restored_through_its_own_row_with_the_same_process(lab):
    before = started(lab)
    parked = controller.park(lab, "web")
    assert [p["name"] for p in parked["phases"]] == [p.value for p in plans.row("container", "park", "registry").phases]
    assert not [x for _, x in lab.world.where("web") if x.serves()] and len(lab.world.registry) == 1
    rec = controller.restore(lab, "web", "node-b")
    assert [p["name"] for p in rec["phases"]] == [p.value for p in plans.row("parked", "stop-copy", "registry").phases]
    assert rec["state"] == "kept" and rec["checkpoint_id"] == parked["id"]
    assert_serves_on(lab, "node-b", before)
    assert_nothing_left(lab)


@pytest.mark.parametrize("phase", ["pull", "restore", "cutover", "verify"])
def test_a_restore_that_fails_in_any_phase_leaves_the_workload_parked(lab, phase):
    from podmigrate.engine import parking

    before = started(lab)
    controller.park(lab, "web")
    role, method, path, skip = CALLS[phase]
    lab.world.fail(AGENT[role], method, path, message=f"{phase} broke", skip=skip)
    with pytest.raises(
        MigrationFailed, match=f"failed in phase {phase}: {phase} broke; rolled back, it is still parked"
    ):
        controller.restore(lab, "web", "node-b")
    assert [e["workload"] for e in parking.listing(lab)] == ["web"] and len(lab.world.registry) == 1
    assert not [x for _, x in lab.world.where("web") if x.serves()]
    assert lab.world.nodes["node-b"].checkpoints == {}
    controller.restore(lab, "web", "node-b")  # and the next one brings it back
    assert_serves_on(lab, "node-b", before)
    assert_nothing_left(lab)


def test_a_second_park_under_a_parked_name_is_refused_and_the_first_stays_restorable(lab):
    from podmigrate.engine import parking

    before = started(lab)
    first = controller.park(lab, "web")
    lab.world.start("node-b", "web")  # a fresh one under the same name meanwhile
    with pytest.raises(UsageError, match="'web' is parked already"):
        controller.park(lab, "web")
    (entry,) = parking.listing(lab)
    assert entry["migration"] == first["id"]
    lab.world.nodes["node-b"].containers.pop("web")
    controller.restore(lab, "web", "node-b")
    assert_serves_on(lab, "node-b", before)
