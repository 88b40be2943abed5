"""What a lab migration's record says crossed between the nodes, and how: computed from what ran (the
agents' answers, the client used), for that migration alone (its plan's ``security`` and
``old_paths``, never a setting of the lab's or of the process); one default transport; and the fake
lab's routes (``tests/fake_lab.py``) held to the real agents' route tables. No root, no lab."""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path
from typing import Any

import pytest

from podmigrate.agent.http import App
from podmigrate.agent.lan import LanAgent
from podmigrate.agent.node import NodeAgent
from podmigrate.bench.engine import variants
from podmigrate.engine import controller, plans, rates
from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import UsageError
from tests.fake_lab import FakeLab, World

# (mode, transport) of every lab container row that moves a workload to another node
ROWS = [(m, t) for (s, m, t) in plans.PLANS if s == "container" and m != "park"]


@pytest.fixture
def lab(tmp_path: Path) -> FakeLab:
    return FakeLab(tmp_path)


def expected_security(mode: str, transport: str, security: str) -> dict[str, Any]:
    """What each row moves, and so what its record may say: nothing about a part that did not cross."""
    on = security == "on"
    sec: dict[str, Any] = {"controller": "MockTransport + token"}  # the fake's agents: no Unix socket
    if mode == "cold":
        return sec  # no checkpoint, no pages, no upload
    sec["sealed"] = on
    if transport in ("stream", "archive"):  # lazy streams too
        sec["agents"] = "mutual TLS (TLSv1.3)"
    if mode == "lazy" or transport == "stream":
        sec["pages"] = "sealed relay" if on else "plain"
    return sec


@pytest.mark.parametrize("security", ["on", "off"])
@pytest.mark.parametrize(("mode", "transport"), ROWS)
def test_the_record_says_how_each_part_crossed_as_the_phases_saw_it(
    lab: FakeLab, mode: str, transport: str, security: str
) -> None:
    lab.world.start("node-a", "web")
    rec = migrate(lab, Plan("web", "node-b", mode, transport, security=security))
    assert rec["status"] == "completed"
    assert rec["security"] == expected_security(mode, transport, security)
    assert "old_paths" not in rec


def test_security_off_belongs_to_one_migration_and_travels_in_its_own_requests(lab: FakeLab) -> None:
    lab.world.start("node-a", "web")
    lab.world.start("node-a", "api")
    off = migrate(lab, Plan("web", "node-b", security="off"))
    on = migrate(lab, Plan("api", "node-b"))  # nothing the first one did carries over

    def asked(rec: Any) -> list[dict[str, Any]]:
        return [b for _, _, path, b in lab.world.bodies if rec["id"] in path or b.get("checkpoint_id") == rec["id"]]

    assert not [b for b in asked(off) if "seal" in b]
    # the page server and the dump into it: both ends told, in the request, to go without CRIU's TLS
    assert [b["criu_tls"] for b in asked(off) if "criu_tls" in b] == [False, False]
    assert all(b["criu_tls"] for b in asked(on) if "criu_tls" in b)
    assert len([b for b in asked(on) if "seal" in b]) >= 3  # page server (relay), dump, key to the target, upload
    assert (off["security"]["sealed"], on["security"]["sealed"]) == (False, True)
    assert (off["security"]["pages"], on["security"]["pages"]) == ("plain", "sealed relay")


def test_old_paths_belong_to_one_migration_and_its_record_lists_the_ones_it_took(lab: FakeLab) -> None:
    lab.world.start("node-a", "web")
    rec = migrate(lab, Plan("web", "node-b", old_paths=("criu-tls-pages", "lazy-prefetch")))
    assert rec["old_paths"] == ["criu-tls-pages"]  # a stop-copy has no prefetch: that one was not on its way
    assert rec["security"]["pages"] == "criu tls"
    back = migrate(lab, Plan("web", "node-a"))
    assert "old_paths" not in back and back["security"]["pages"] == "sealed relay"


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (Plan("web", "node-b", security="maybe"), "security is on or off"),
        (Plan("web", "node-b", old_paths=("fast",)), "no such change: fast"),
    ],
)
def test_a_migration_asking_for_an_unknown_security_or_old_path_is_refused(
    lab: FakeLab, plan: Plan, message: str
) -> None:
    lab.world.start("node-a", "web")
    with pytest.raises(UsageError, match=message):
        migrate(lab, plan)
    assert not lab.world.bodies or all(m == "GET" for _, m, _, _ in lab.world.bodies)  # nothing changed


class _Identity:
    """What a node agent needs of its certificates to build its routes (no files)."""

    def client(self) -> ssl.SSLContext:
        return ssl.create_default_context()

    def criu(self, *, server: bool) -> tuple[str, ...]:
        return ("tls", "tls-no-cn-verify") if server else ("tls",)


def _node_agent(tmp_path: Path) -> NodeAgent:
    return NodeAgent(App("node-a", "node", "t"), object(), _Identity(), tmp_path / "cp", tmp_path / "notice")  # type: ignore[arg-type]


def test_a_node_agent_takes_criu_tls_from_each_request_and_is_secure_unless_told(tmp_path: Path) -> None:
    agent = _node_agent(tmp_path)
    assert agent.criu_tls({}, server=True) == ("tls", "tls-no-cn-verify")  # a request that says nothing: on
    assert agent.criu_tls({"criu_tls": True}, server=False) == ("tls",)
    assert agent.criu_tls({"criu_tls": False}, server=True) == ()
    assert not hasattr(agent, "setting")  # no lab-wide file for anyone to switch


def test_one_default_transport_for_the_library_the_cli_and_the_demo(lab: FakeLab) -> None:
    from podmigrate.cli.migrate import migrate as command

    assert Plan("web", "node-b").transport == controller.DEFAULT_TRANSPORT == plans.DEFAULT_TRANSPORT == "stream"
    option = next(p for p in command.params if p.name == "transport")
    assert option.default == plans.DEFAULT_TRANSPORT
    lab.world.start("node-a", "web")
    rec = migrate(lab, Plan("web", "node-b"))
    assert rec["transport"] == "stream" and "page-server" in rec["phase_s"]


def test_the_engine_bench_puts_security_and_old_paths_into_each_migrations_plan() -> None:
    before = dict(os.environ)
    compared = variants(("on", "off"), (), ("off",), None)
    assert [(v.label, v.plan) for v in compared] == [
        ("security on", {"security": "on"}),
        ("security off", {"security": "off"}),
    ]
    paired = variants(("on",), ("eager-restore",), ("off",), None)
    assert [(v.label, v.plan) for v in paired] == [
        ("new path", {"security": "on"}),
        ("old path: eager-restore", {"security": "on", "old_paths": ("eager-restore",)}),
    ]
    for v in (*compared, *paired):
        v.apply()
        Plan("web", "node-b", **v.plan)  # each a valid plan of one migration
    assert dict(os.environ) == before  # nothing process-wide


def test_evacuation_rates_learn_only_from_migrations_run_as_this_lab_runs_them() -> None:
    one = {"status": "completed", "mode": "stop-copy", "transport": "stream", "rss_bytes": 1 << 30,
           "blackout_s": 9.0, "phases": [{"name": "checkpoint", "started": 0.0, "ended": 60.0}]}  # fmt: skip
    variants_of_a_bench = [{**one, "plan": {"security": "off"}}, {**one, "plan": {"old_paths": ["eager-restore"]}}]
    assert rates.learn(variants_of_a_bench)["stop-copy/stream"].basis.startswith("default")
    assert rates.learn([{**one, "plan": {"security": "on"}}])["stop-copy/stream"].basis == "measured: 1 migrations"


# ------------------------------------------------------------------ the fake lab's routes

# real routes the fake does not serve, and why the engine's tests do without them; a real route the
# fake lacks and that is not here fails the test below, and so does an entry here that is stale
NOT_FAKED: dict[str, dict[tuple[str, str], str]] = {
    "node": {
        ("GET", "/v1/checkpoints"): "gc and the lab tests list archives; the fake's leftovers() says the same",
        ("PUT", "/v1/checkpoints/([^/]+)"): "agent to agent: the fake's send moves the snapshot itself",
        ("POST", "/v1/checkpoints/([^/]+)/commit"): "agent to agent, as the upload",
        ("GET", "/v1/containers/([^/]+)/skeleton"): "speculative restore: the engine goes on without it (not used)",
        ("POST", "/v1/checkpoints/([^/]+)/speculate"): "speculative restore, as the skeleton",
        ("DELETE", "/v1/checkpoints/([^/]+)/speculate"): "speculative restore, as the skeleton",
        ("POST", "/v1/pods"): "pods move in the real lab's tests only",
        ("GET", "/v1/pods/([^/]+)"): "pods",
        ("POST", "/v1/pods/([^/]+)/checkpoint"): "pods",
        ("POST", "/v1/pods/([^/]+)/restore"): "pods",
        ("POST", "/v1/pods/([^/]+)/restore-in-place"): "pods",
        ("POST", "/v1/checkpoints/([^/]+)/send-pod"): "pods",
        ("POST", "/v1/images/send"): "an image missing on the target: the fake's nodes have every image",
        ("POST", "/v1/images/load"): "as images/send",
        ("POST", "/v1/l2/withdraw"): "hosts on a shared segment: tests/test_hosts_lab.py moves real addresses",
        ("POST", "/v1/l2/announce"): "as l2/withdraw",
        ("PUT", "/v1/notice"): "Spot notices: evacuation's tests fake the notice itself",
        ("GET", "/v1/notice"): "Spot notices",
        ("DELETE", "/v1/notice"): "Spot notices",
        ("GET", "/latest/meta-data/spot/instance-action"): "Spot notices",
    },
    "lan": {
        ("GET", "/v1/info"): "lab status only",
        ("GET", "/v1/router"): "the router choice: lab commands, not a migration",
        ("PUT", "/v1/router"): "the router choice",
        ("GET", "/v1/routes"): "lab status and gc",
        ("DELETE", "/v1/routes/([0-9.]+)"): "gc and workload stop",
        ("POST", "/v1/routes/([0-9.]+)/drain"): "draining needs the nft router: real lab tests",
        ("POST", "/v1/connections"): "held client connections: real lab tests",
        ("GET", "/v1/connections/([0-9a-f]+)"): "held client connections",
        ("DELETE", "/v1/connections/([0-9a-f]+)"): "held client connections",
    },
}


def _table(app: App) -> set[tuple[str, str]]:
    """(method, path pattern) of every route, the parameters' names left out (the fake names them
    differently; what each accepts is kept)."""
    return {(method, re.sub(r"\(\?P<\w+>", "(", rx.pattern)) for method, rx, _fn, _peer in app.routes}


def _real(role: str, tmp_path: Path) -> App:
    if role == "node":
        agent = _node_agent(tmp_path)
        agent.register()
        return agent.app
    app = App("lan", "lan", "t")
    LanAgent(app).register()
    return app


@pytest.mark.parametrize(("role", "fake_name"), [("node", "node-a"), ("lan", "lan")])
def test_the_fake_labs_routes_are_the_real_agents_routes(tmp_path: Path, role: str, fake_name: str) -> None:
    real, fake = _table(_real(role, tmp_path)), _table(World().apps[fake_name])
    assert sorted(fake - real) == [], "the fake serves routes the real agent does not have"
    missing = real - fake
    assert sorted(missing - set(NOT_FAKED[role])) == [], "real routes the fake lacks: fake them or list them"
    assert sorted(set(NOT_FAKED[role]) - missing) == [], "listed as not faked, but faked or gone from the agent"
