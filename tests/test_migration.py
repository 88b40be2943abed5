"""Checkpoint/restore and cross-node migration in a real lab: state, connections, bad input, rollback."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from podmigrate import layout
from podmigrate.engine.controller import Plan, migrate, recover, store_for
from podmigrate.engine.phases import lazy
from podmigrate.errors import LabError, MigrationFailed, UsageError
from podmigrate.transport import seal
from podmigrate.workload import manage
from podmigrate.workload.image import workload_image

from .conftest import LAB_NAME, hold_connection, wait_for

pytestmark = pytest.mark.lab


def node_files(lab: Any, node: str) -> list[str]:
    return [c["id"] for c in lab.agent(node).get("/v1/checkpoints")]


def registry_tags(lab: Any, repo: str) -> list[str]:
    res = manage.lan_get(lab, f"http://{layout.REGISTRY}/v2/{repo}/tags/list")
    if not res["ok"]:
        return []
    return json.loads(res["body"]).get("tags") or []


def assert_clean(lab: Any, name: str) -> None:
    """No checkpoint archives on any node, no checkpoint image tag, no stopped copies."""
    for n in lab.nodes:
        assert node_files(lab, n) == [], f"archives left on {n}"
    assert registry_tags(lab, f"podmigrate/checkpoints/{name}") == []
    copies = [(n, c["state"]) for n, cs in manage.inventory(lab).items() for c in cs if c["name"] == name]
    assert len(copies) == 1 and copies[0][1] == "running", copies


def test_workload_state_is_read_through_its_service_address(lab, workload):
    st = workload(heap_mb=32)
    assert st["node"] == "node-a" and st["heap_mb"] == 32
    assert layout.in_workload_subnet(st["ip"])
    assert len(st["sha256"]) == 64 and st["counter"] >= 0 and st["pid"] == 1
    again = manage.state(lab, st["name"])
    assert again["sha256"] == st["sha256"] and again["counter"] >= st["counter"]
    via = lab.agent("lan").get(f"/v1/routes/{st['ip']}")["via"]
    assert via == layout.node_ip("node-a")


@pytest.mark.parametrize("heap", [0, -5])
def test_a_heap_of_zero_or_negative_size_is_refused_and_starts_nothing(lab, heap):
    before = manage.inventory(lab)
    with pytest.raises(UsageError, match="heap size must be a positive number of MB"):
        manage.start(lab, "badheap", "node-a", heap)
    assert manage.inventory(lab) == before


def test_unknown_node_and_taken_name_are_refused(lab, workload):
    st = workload(heap_mb=16)
    with pytest.raises(UsageError, match="no node 'node-z'"):
        manage.start(lab, "elsewhere", "node-z", 16)
    with pytest.raises(UsageError, match="already used"):
        manage.start(lab, st["name"], "node-b", 16)


def test_checkpoint_and_restore_on_one_node_keeps_the_heap(lab, workload):
    st = workload(heap_mb=64)
    a = lab.agent("node-a")
    res = a.post(f"/v1/containers/{st['name']}/checkpoint", {"checkpoint_id": "local-test"})
    assert res["stats"]["pages_written"] > 64 * 256 * 0.9  # 4 KiB pages of a 64 MB heap
    assert res["archive_bytes"] > 64 << 20
    stopped = [c for c in manage.inventory(lab)["node-a"] if c["name"] == st["name"]]
    assert stopped[0]["state"] == "exited"  # stop-and-copy: the checkpoint stopped it
    a.post(f"/v1/containers/{st['name']}/restore", {})
    a.delete("/v1/checkpoints/local-test")
    after = manage.state(lab, st["name"])
    assert after["sha256"] == st["sha256"]
    assert after["counter"] >= st["counter"] and after["started"] == st["started"]


def test_migration_there_and_back_keeps_digest_and_counter(lab, workload):
    st = workload(heap_mb=64)
    name = st["name"]
    there = migrate(lab, Plan(workload=name, target="node-b", transport="registry"))
    back = migrate(lab, Plan(workload=name, target="node-a", transport="registry"))
    for rec, src, dst in ((there, "node-a", "node-b"), (back, "node-b", "node-a")):
        assert rec["status"] == "completed" and rec["source"] == src and rec["target"] == dst
        assert rec["state_after"]["sha256"] == st["sha256"]
        assert rec["checks"] == {"sha256_equal": True, "counter_not_backwards": True, "same_process_start": True}
        assert rec["blackout_method"] == "probe" and rec["blackout_s"] > 0
        assert not rec["blackout"]["counters"]["went_backwards"]
        assert [p["name"] for p in rec["phases"]] == [
            "validate",
            "checkpoint",
            "push",
            "pull",
            "restore",
            "cutover",
            "verify",
            "cleanup",
        ]
        assert all(p["ok"] and p["ended"] >= p["started"] for p in rec["phases"])
        # the layer is the archive sealed for the migration (transport.seal)
        assert rec["bytes"]["pushed"] == rec["bytes"]["pulled"] == seal.sealed_size(rec["bytes"]["archive"])
        assert rec["bytes"]["archive"] > 64 << 20
        assert rec["criu"]["dump"]["pages_written"] > 0 and rec["criu"]["restore"]["pages_restored"] > 0
        assert rec["service_addresses"] == [st["ip"]]
    assert there["state_after"]["counter"] <= back["state_before"]["counter"]
    final = manage.state(lab, name)
    assert final["node"] == "node-a" and final["ip"] == st["ip"] and final["sha256"] == st["sha256"]
    assert_clean(lab, name)
    stored = store_for(lab).get(back["id"])
    assert stored is not None and stored["status"] == "completed"


def test_an_open_client_tcp_connection_survives_the_migration(lab, workload):
    st = workload(heap_mb=32)
    lan = lab.agent("lan")
    cid = hold_connection(lan, st["ip"])
    migrate(lab, Plan(workload=st["name"], target="node-b"))
    before = lan.get(f"/v1/connections/{cid}")["requests"]
    wait_for(
        lambda: lan.get(f"/v1/connections/{cid}")["requests"] >= before + 10,
        60,
        "requests over the same connection after the migration",
    )
    final = lan.delete(f"/v1/connections/{cid}")
    assert final["error"] is None and final["same_connection"], final
    assert not final["counter_went_backwards"]
    assert final["last_counter"] > final["first_counter"]


def test_a_container_started_by_hand_with_podman_migrates(lab):
    name = "byhand"
    lab.run("node-a", ["podman", "rm", "-f", "-t", "0", name], check=False)
    lab.run("node-a", ["podman", "run", "-d", "--name", name, "--network", "mig", "-e", "HEAP_MB=16", workload_image()])
    ip = manage.locate(lab, name).ips[0]
    manage.set_route(lab, ip, "node-a")  # a route for the LAN to reach it (the node's /24 does too)
    before: dict[str, Any] = wait_for(lambda: manage.read_state(lab, ip, timeout=2), 60, "hand-made container answers")
    try:
        rec = migrate(lab, Plan(workload=name, target="node-b", probe="tcp:8000"))
        assert rec["status"] == "completed" and rec["blackout_method"] == "probe"
        after = manage.read_state(lab, ip)
        assert after is not None and after["sha256"] == before["sha256"] and after["counter"] >= before["counter"]
        assert manage.locate(lab, name).node == "node-b"
    finally:
        manage.stop(lab, name)


def test_bad_migration_requests_are_refused_and_change_nothing(lab, workload):
    st = workload(heap_mb=16)
    name = st["name"]
    store = store_for(lab)
    known = {r["id"] for r in store.list()}
    cases = [
        (Plan(workload=name, target="node-z"), "no node 'node-z'"),
        (Plan(workload="no-such-container", target="node-b"), "no container named 'no-such-container'"),
        (Plan(workload=name, target="node-a"), "already runs on node-a"),
        (Plan(workload=name, target="node-b", mode="teleport"), "unknown mode"),
        (Plan(workload=name, target="node-b", probe="udp:1"), "not a probe"),
    ]
    for plan, message in cases:
        with pytest.raises(UsageError, match=message):
            migrate(lab, plan)
    loc = manage.locate(lab, name)
    assert loc.node == "node-a" and loc.container["id"] == manage.locate(lab, name).container["id"]
    assert manage.state(lab, name)["started"] == st["started"]
    assert {r["id"] for r in store.list()} == known
    assert_clean(lab, name)


def test_cli_reports_errors_for_people(lab):
    env = {"PODMIGRATE_LAB": LAB_NAME}
    res = CliRunner().invoke(__import__("podmigrate.cli").cli.main, ["migrate", "nope", "--to", "node-b"], env=env)
    assert res.exit_code == 1
    assert "ERROR: no container named 'nope'" in res.output and "hint:" in res.output
    res = CliRunner().invoke(
        __import__("podmigrate.cli").cli.main,
        ["workload", "start", "heap", "--node", "node-a", "--name", "zero", "--heap-mb", "0"],
        env=env,
    )
    assert res.exit_code == 1 and "heap size must be a positive number" in res.output


def test_registry_down_during_push_rolls_back_to_the_source(lab, workload):
    st = workload(heap_mb=32)
    hold = lab.dir / "hold" / "registry"
    hold.touch()
    lab.kill_service("registry", signal.SIGKILL)
    try:
        with pytest.raises(MigrationFailed, match=r"failed in phase push.*rolled back") as exc:
            migrate(lab, Plan(workload=st["name"], target="node-b", transport="registry"))
    finally:
        hold.unlink()
    rec = exc.value.details["record"]
    assert rec["status"] == "rolled_back"
    assert [r["phase"] for r in rec["rollbacks"]] == ["push", "checkpoint"]
    assert rec["rollbacks"][1]["ok"] and "restored" in rec["rollbacks"][1]["did"]
    after = manage.state(lab, st["name"])
    assert after["node"] == "node-a" and after["sha256"] == st["sha256"] and after["counter"] >= st["counter"]
    wait_for(lambda: manage.lan_get(lab, f"http://{layout.REGISTRY}/v2/", timeout=1)["ok"], 30, "registry back")
    assert_clean(lab, st["name"])


def test_a_controller_killed_mid_migration_is_rolled_back_by_the_next_command(lab, workload):
    st = workload(heap_mb=128)
    name = st["name"]
    code = (
        "from podmigrate.lab.cluster import Lab; from podmigrate.engine.controller import Plan, migrate; "
        f"migrate(Lab({LAB_NAME!r}), Plan(workload={name!r}, target='node-b', transport='registry'))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    store = store_for(lab)

    def in_transfer() -> bool:
        return any(r["workload"] == name and r["phase"] in ("push", "pull") for r in store.list(status="running"))

    try:
        wait_for(in_transfer, 120, "the migration to reach push or pull", step=0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = recover(lab, store)
    rec = next(r for r in done if r["workload"] == name)
    assert rec["status"] == "rolled_back" and rec["rollbacks"][-1]["phase"] == "checkpoint"
    after = manage.state(lab, name)
    assert after["node"] == "node-a" and after["sha256"] == st["sha256"]
    assert_clean(lab, name)


def test_exec_on_an_unknown_node_or_a_failing_command_says_so(lab):
    with pytest.raises(UsageError, match="targets are: lab, lan, node-a, node-b"):
        lab.run("node-q", ["true"])
    with pytest.raises(LabError, match="failed on node-a"):
        lab.run("node-a", ["sh", "-c", "exit 3"])
    assert lab.run("node-b", ["hostname", "-I"]).stdout.split()[0] == layout.node_ip("node-b")


def test_a_pod_moves_whole_and_the_loopback_connection_through_its_sidecar_survives(lab, workload):
    st = workload(heap_mb=16, sidecar=True)
    pod = st["name"].removesuffix("-server")
    # the server listens on 127.0.0.1:8090 only: an answer at the pod's address went through the sidecar
    assert manage.state(lab, pod)["sha256"] == st["sha256"]
    with pytest.raises(UsageError, match="pods move with --mode stop-copy or decoupled"):
        migrate(lab, Plan(workload=pod, target="node-b", mode="lazy"))
    lan = lab.agent("lan")
    cid = hold_connection(lan, st["ip"])
    rec = migrate(lab, Plan(workload=pod, target="node-b"))
    assert rec["scope"] == "pod" and rec["pod"]["members"] == [f"{pod}-server", f"{pod}-sidecar"]
    assert sorted(rec["member_images"]) == [f"{pod}-server", f"{pod}-sidecar"]  # each member's image, by ID
    assert rec["checks"] == {"sha256_equal": True, "counter_not_backwards": True, "same_process_start": True}
    after = manage.state(lab, pod)
    assert after["node"] == "node-b" and after["ip"] == st["ip"]
    before = lan.get(f"/v1/connections/{cid}")["requests"]
    wait_for(
        lambda: lan.get(f"/v1/connections/{cid}")["requests"] >= before + 10,
        60,
        "requests through the sidecar over the same connection after the migration",
    )
    final = lan.delete(f"/v1/connections/{cid}")
    assert final["error"] is None and final["same_connection"] and not final["counter_went_backwards"], final
    for node, ctrs in manage.inventory(lab).items():  # nothing of the pod left on the source
        assert node == "node-b" or not [c for c in ctrs if c["name"].startswith(pod)]


def test_checkpointing_one_member_of_a_pod_keeps_its_state_but_severs_the_sidecars_connection(lab, workload):
    st = workload(heap_mb=16, sidecar=True)
    pod = st["name"].removesuffix("-server")
    with pytest.raises(UsageError, match="has no member"):
        migrate(lab, Plan(workload=pod, target="node-b", only=("db",)))
    lan = lab.agent("lan")
    cid = hold_connection(lan, st["ip"])
    rec = migrate(lab, Plan(workload=pod, target="node-b", only=(f"{pod}-server",)))
    assert rec["pod"]["checkpointed"] == [f"{pod}-server"] and [f["name"] for f in rec["pod"]["fresh"]] == [
        f"{pod}-sidecar"
    ]
    assert "severed" in rec["warnings"][0]
    # the checkpointed server kept its memory; the sidecar is a new process that never saw the client
    assert rec["checks"]["sha256_equal"] and manage.state(lab, pod)["node"] == "node-b"
    final = wait_for(
        lambda: (c := lan.get(f"/v1/connections/{cid}"))["error"] and c,
        30,
        "the client's connection through the old sidecar to break",
    )
    assert final["error"]
    lan.delete(f"/v1/connections/{cid}")


@pytest.mark.parametrize(
    ("mode", "transport"),
    [
        ("stop-copy", "stream"),
        ("stop-copy", "archive"),
        ("decoupled", "registry"),
        ("decoupled", "stream"),
        ("lazy", "stream"),
    ],
)
def test_each_mode_and_transport_goes_there_and_back_with_the_heap_intact(lab, workload, mode, transport):
    st = workload(heap_mb=32)
    name = st["name"]
    recs = [migrate(lab, Plan(workload=name, target=t, mode=mode, transport=transport)) for t in ("node-b", "node-a")]
    for rec in recs:
        assert rec["status"] == "completed" and rec["state"] == "kept"
        assert rec["state_after"]["sha256"] == st["sha256"]
        assert rec["checks"]["same_process_start"]
        assert rec["drift"]["counter"] >= 0
        if transport in ("stream", "archive"):
            assert "transfer" in rec["phase_s"] and "push" not in rec["phase_s"]
            assert rec["bytes"]["sent"] == rec["bytes"]["archive"]
            assert rec["security"]["agents"].startswith("mutual TLS (TLSv1.")  # the upload, agent to agent
        else:
            assert "agents" not in rec["security"]  # the registry between them: no agent-to-agent upload
        # what crossed, as the phases saw it cross: sealed always (the default), and the controller
        # over the agents' Unix sockets
        assert rec["security"]["sealed"] is True and rec["security"]["controller"] == "unix socket + token"
        # by (mode, transport), so that a page server gone missing fails here instead of skipping the
        # checks below: a streamed copy's pages go into the target's page server during the dump; a
        # lazy copy fetches them from the source's CRIU (through the agents' sealed relay too); registry
        # and archive carry them inside the checkpoint
        paged = transport == "stream" and mode != "lazy"
        assert bool(rec.get("page_server")) is paged, rec.get("page_server")
        assert rec["security"].get("pages") == ("sealed relay" if paged or mode == "lazy" else None)
        if mode == "lazy":  # the heap beyond the prefetched small mappings crossed in the relay
            assert rec["lazy"]["relay_bytes"]["pages"] >= 16 << 20, rec["lazy"]
        if paged:  # the lab seals: the pages crossed in the agents' sealed relay
            assert rec["bytes"]["page_relay"]["pages"] >= 32 << 20
            # the restore left the memory in the images for a local lazy-pages daemon, which had
            # copied every page in (exit 0) before verify read the heap
            assert rec["lazy_local"] and rec["local_pages"]["daemon_rc"] == 0
            if mode == "stop-copy":  # and podman's part of the restore had waited at its gate since before the freeze
                assert rec["speculative"]["state"] == "used", rec["speculative"]
            assert list(rec["phase_s"]).index("pages") < list(rec["phase_s"]).index("verify")
        if mode == "lazy":  # the source was released only after every page had moved
            assert rec["lazy"]["source_rc"] == 0 and rec["lazy"]["daemon_rc"] == 0
            # the pages stayed in the frozen source until asked for (podmigrate's CRIU, lab.criu_build)
            assert rec["lazy"]["dump_mode"] == "read"
            # the 32 MB heap crossed the LAN on demand, counted on the source's LAN link
            assert 32 << 20 <= rec["bytes"]["pages"] < 64 << 20 and rec["bytes_moved"] >= rec["bytes"]["pages"]
            assert rec["bytes"]["archive"] < 8 << 20  # no memory pages in what was sent up front
            # beside it, the small mappings' pages, read from the frozen source (agent.node_prefetch),
            # made present before CRIU restored the tasks; the heap was not among them
            pre = rec["lazy"]["prefetch"]
            assert pre["source"] == "sent" and pre["outcome"] in ("used", "missed"), pre
            assert 0 < pre["bytes"] < 32 << 20 and pre["mappings"] > 0
            # podman's part of the restore ran before the freeze and waited at runc's gate
            assert rec["speculative"]["state"] == "used" and rec["speculative"]["podman_s"] > 0, rec["speculative"]
            assert "target: unpacking, placing at the gate, lazy-pages daemon start" in rec["blackout_steps"]["steps"]
        if mode == "lazy" or rec.get("lazy_local"):
            # userfaultfd filled the heap 4 KB at a time; numpy had madvised it: its huge pages came back,
            # in the target agent's background after the migration (agent.collapses)
            assert rec["huge_pages"]["state"] == "collapsing", rec["huge_pages"]
            collapsed = lazy.collapsed(lab, rec)
            assert collapsed["state"] == "done" and collapsed["collapsed_bytes"] >= 16 << 20, collapsed
        if mode == "decoupled":
            # make-before-break: the copy was up before the switch, so at the cutover at most a probe
            # caught mid-handshake at the very instant of the switch fails (its ACK reaches the copy)
            assert rec["blackout"]["at_cutover"]["failed"] <= 2
            assert rec["drift"]["since_checkpoint_s"] > 0
        else:
            assert rec["drift"] == {"counter": 0, "since_checkpoint_s": 0.0}
    assert manage.state(lab, name)["node"] == "node-a"
    assert_clean(lab, name)


def test_cold_restart_starts_afresh_on_the_target_and_says_the_state_is_lost(lab, workload):
    st = workload(heap_mb=16)
    rec = migrate(lab, Plan(workload=st["name"], target="node-b", mode="cold"))
    assert rec["status"] == "completed" and rec["transport"] == "none"
    assert rec["state"] == "lost"
    assert not rec["checks"]["same_process_start"]
    after = manage.state(lab, st["name"])
    assert after["node"] == "node-b" and after["ip"] == st["ip"]
    assert after["started"] != st["started"] and after["counter"] < rec["state_before"]["counter"] + 1000
    # the environment's values stay out of the record (and state.db); the fresh copy still has them
    stored = store_for(lab).get(rec["id"])
    assert stored is not None and stored["spec"]["env"] and set(stored["spec"]["env"].values()) == {"(not recorded)"}
    live = lab.agent("node-b").get(f"/v1/containers/{st['name']}/spec")["env"]
    assert set(live) == set(stored["spec"]["env"]) and live["HEAP_MB"] == "16"
    assert_clean(lab, st["name"])


def test_gc_finds_and_removes_leftovers_and_history_lists_migrations(lab, workload):
    from podmigrate.engine import gc

    st = workload(heap_mb=16)
    a = lab.agent("node-a")
    a.post(f"/v1/containers/{st['name']}/checkpoint", {"checkpoint_id": "stray-1"})
    a.post(f"/v1/containers/{st['name']}/restore", {})
    ref = f"{layout.REGISTRY}/podmigrate/checkpoints/stray:stray-1"
    a.post("/v1/checkpoints/stray-1/push", {"reference": ref, "annotations": {"x": "y"}})
    lab.agent("lan").put("/v1/routes/10.89.9.9", {"via": layout.node_ip("node-b")})
    listed = gc.collect(lab, dry_run=True)
    assert "node-a:stray-1.tar" in listed["archives"]
    assert ref in listed["images"]
    assert any(r.startswith("10.89.9.9 ") for r in listed["routes"])
    assert gc.collect(lab, dry_run=True) == listed  # a dry run removes nothing
    gc.collect(lab)
    assert gc.summary(gc.collect(lab, dry_run=True)) == "nothing to collect"
    from podmigrate.lab import registry_gc

    freed = registry_gc.collect(lab)  # the stray image's tag is gone; now its 16 MB of blobs
    assert freed["bytes_before"] - freed["bytes_after"] > 8 << 20, freed
    assert manage.lan_get(lab, f"http://{layout.REGISTRY}/v2/")["ok"]  # and the registry serves again
    assert manage.state(lab, st["name"])["sha256"] == st["sha256"]
    res = CliRunner().invoke(
        __import__("podmigrate.cli").cli.main, ["history", "--json"], env={"PODMIGRATE_LAB": LAB_NAME}
    )
    assert res.exit_code == 0 and all(r["status"] in ("completed", "rolled_back") for r in json.loads(res.output))


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_a_compressed_checkpoint_image_restores_bit_exact(lab, workload, compression):
    st = workload(heap_mb=16)
    rec = migrate(lab, Plan(workload=st["name"], target="node-b", transport="registry", compression=compression))
    assert rec["status"] == "completed" and rec["state_after"]["sha256"] == st["sha256"]
    assert rec["plan"]["compression"] == compression
    assert_clean(lab, st["name"])
    with pytest.raises(UsageError, match="registry transport only"):
        migrate(lab, Plan(workload=st["name"], target="node-a", transport="stream", compression=compression))


def test_a_small_suite_produces_a_valid_report(lab, tmp_path):
    from podmigrate.bench import report, suite

    rows = suite.run(lab, tmp_path, runs=2, cold=1, heap_mb=64, groups=("decoupled", "stop-copy", "lazy"), warmup=0)
    assert sorted({r["group"] for r in rows}) == ["cold", "decoupled", "lazy", "stop-copy"]
    assert all(r["sha256_equal"] for r in rows if r["group"] != "cold")
    again = suite.run(lab, tmp_path, runs=2, cold=1, heap_mb=64, groups=("decoupled", "stop-copy", "lazy"), warmup=0)
    assert len(again) == len(rows)  # resumed: nothing left to run
    # an engine benchmark's table in the same directory adds its plots and table (synthetic here)
    table = [
        {
            "heap_mb": h,
            "method": m,
            "n": 1,
            "blackout_s": b,
            "blackout_cutover_s": None,
            "phase_s": {"checkpoint": b / 2, "restore": b / 2},
        }
        for h, m, b in ((64, "stop-copy/stream", 0.9), (1024, "stop-copy/stream", 5.1), (64, "cold restart", 0.6))
    ]
    (tmp_path / "bench.json").write_text(json.dumps({"table": table}))
    res = report.build(tmp_path)
    assert res["groups"]["stop-copy"]["n"] == 2 and res["groups"]["cold"]["n"] == 1
    assert any(s["metric"].startswith("1 GB evacuation") for s in res["study_side_by_side"])
    assert {s["metric"].split()[0] for s in res["study_side_by_side"]} >= {"Mode", "Cold"}
    md = (tmp_path / "report.md").read_text()
    assert "Beside the study" in md and "Mann-Whitney" in md and "| decoupled | 2 |" in md
    for png in (
        "blackout-by-mode.png",
        "phases.png",
        "timeline-stop-copy.png",
        "blackout-vs-heap.png",
        "phases-by-heap.png",
    ):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--network", "mig", "-v", "/var/tmp:/data"], "bind /var/tmp -> /data: their files stay on the source"),
        (["--network", "mig", "-p", "18080:8000"], "publishes ports ['8000/tcp']"),
        ([], "is on network 'podman', not the cluster's 'mig'"),
        (["--network", "mig", "--device", "/dev/null:/dev/xnull"], "uses host devices ['/dev/null']"),
    ],
    ids=["bind-mount", "published-port", "default-network", "device"],
)
def test_what_cannot_move_with_a_container_is_refused_before_anything_is_frozen(lab, args, message):
    name = "cannot-move"
    lab.run("node-a", ["podman", "rm", "-f", "-t", "0", name], check=False)
    lab.run("node-a", ["podman", "run", "-d", "--name", name, *args, "-e", "HEAP_MB=8", workload_image()])
    store = store_for(lab)
    known = {r["id"] for r in store.list()}
    try:
        with pytest.raises(UsageError, match=re.escape(message)):
            migrate(lab, Plan(workload=name, target="node-b", probe="tcp:8000"))
        state = lab.run("node-a", ["podman", "inspect", "-f", "{{.State.Status}}", name]).stdout.strip()
        assert state == "running"  # never checkpointed, never frozen
        assert {r["id"] for r in store.list()} == known  # and no record: nothing happened
    finally:
        lab.run("node-a", ["podman", "rm", "-f", "-t", "0", name], check=False)


@pytest.mark.parametrize("on_target", ["missing", "same-name-other-image"])
def test_a_container_of_an_image_made_on_the_source_alone_migrates_with_its_image(lab, on_target):
    """Built or imported on the source only (podman build, commit, import, load): the target cannot pull
    it, and an image of the same name there is another image; the image moves before the freeze."""
    name, image = "localmade", "localhost/podmigrate-local:1"
    for node in lab.nodes:
        lab.run(node, ["podman", "rm", "-f", "-t", "0", name], check=False)
        lab.run(node, ["podman", "rmi", "-f", image], check=False)
    base = workload_image()
    build = (
        f"c=$(buildah from {base}) && buildah config --env MADE_HERE=1 $c >/dev/null && "
        f"buildah commit -q $c {image} >/dev/null && buildah rm $c >/dev/null"
    )
    lab.run("node-a", ["sh", "-c", build])
    if on_target == "same-name-other-image":
        lab.run("node-b", ["podman", "pull", "-q", base])
        lab.run("node-b", ["podman", "tag", base, image])
    lab.run("node-a", ["podman", "run", "-d", "--name", name, "--network", "mig", "-e", "HEAP_MB=16", image])
    ip = manage.locate(lab, name).ips[0]
    manage.set_route(lab, ip, "node-a")
    before: dict[str, Any] = wait_for(lambda: manage.read_state(lab, ip, timeout=2), 60, "the container answers")
    said: list[str] = []
    try:
        rec = migrate(lab, Plan(workload=name, target="node-b", transport="stream", probe="tcp:8000"), said.append)
        assert rec["status"] == "completed", rec.get("error")
        assert any("moving image localhost/podmigrate-local:1" in m for m in said), said
        assert rec["target_image"]["moved_bytes"] > 0
        after = manage.read_state(lab, ip)
        assert after is not None and after["sha256"] == before["sha256"] and after["started"] == before["started"]
        src_id = lab.run("node-a", ["podman", "image", "inspect", "-f", "{{.Id}}", image]).stdout.strip()
        dst_id = lab.run("node-b", ["podman", "image", "inspect", "-f", "{{.Id}}", image]).stdout.strip()
        assert src_id == dst_id  # by ID: the source's image, not the one of the same name
    finally:
        manage.stop(lab, name)
        for node in lab.nodes:
            lab.run(node, ["podman", "rmi", "-f", image], check=False)


def test_each_node_reports_its_cpu_and_checks_another_nodes_with_criu(lab):
    import base64

    a, b = lab.agent("node-a"), lab.agent("node-b")
    image = a.get("/v1/info")["cpuinfo"]
    assert image and b.get("/v1/info")["cpuinfo"] == image  # the lab's nodes share one CPU
    assert b.post("/v1/cpuinfo/check", {"image": image})["why"] is None
    damaged = base64.b64encode(base64.b64decode(image)[:16]).decode()  # a cut-off image: CRIU refuses it
    why = b.post("/v1/cpuinfo/check", {"image": damaged})["why"]
    assert why, why
