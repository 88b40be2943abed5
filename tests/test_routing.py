"""Service-address routers in a real lab: the /32 route and the conntrack-aware nftables map.

The nft router's point is draining: a decoupled migration sends new connections to the copy at
once, while a connection open at the cutover keeps being served by the source until it ends (or the
drain deadline passes). Stop-copy must not drain: its restored TCP connections move with it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import PodmigrateError
from podmigrate.routing.nft import mark_of, pinned_elsewhere
from podmigrate.workload import manage

from .conftest import hold_connection, wait_for

A, B = mark_of("10.77.0.11"), mark_of("10.77.0.12")


def ct(timeout: int, state: str, dst: str, sport: int, mark: int, proto: str = "tcp      6") -> str:
    """One line of /proc/net/nf_conntrack, as the kernel writes it."""
    orig = f"src=10.77.0.1 dst={dst} sport={sport} dport=8000"
    reply = f"src={dst} dst=10.77.0.1 sport=8000 dport={sport}"
    return f"ipv4     2 {proto} {timeout} {state} {orig} {reply} [ASSURED] mark={mark} zone=0 use=2\n"


CONNTRACK = "".join(
    [
        ct(431990, "ESTABLISHED", "10.89.1.7", 40000, A),
        ct(119, "SYN_SENT", "10.89.1.7", 40001, A),  # sent a second ago
        ct(60, "SYN_SENT", "10.89.1.7", 40002, A),  # its client gave up a minute ago
        ct(100, "TIME_WAIT", "10.89.1.7", 40003, A),
        ct(431990, "ESTABLISHED", "10.89.1.7", 40004, B),
        ct(431990, "ESTABLISHED", "10.89.1.7", 40005, 0),
        ct(431990, "ESTABLISHED", "10.89.1.8", 40006, A),
        # UDP has no state column
        f"ipv4     2 udp      17 20 src=10.77.0.1 dst=10.89.1.7 sport=5353 dport=53 [UNREPLIED] mark={A} zone=0\n",
    ]
)


def test_only_open_connections_pinned_to_another_node_hold_a_drain(tmp_path: Path) -> None:
    table = tmp_path / "nf_conntrack"
    table.write_text(CONNTRACK)
    # pinned to node-a while node-b owns 10.89.1.7: the established one and the SYN sent just now;
    # not the SYN its client gave up on a minute ago, TIME_WAIT, node-b's own, unmarked, other
    # addresses or UDP
    assert pinned_elsewhere("10.89.1.7", B, str(table)) == 2
    assert pinned_elsewhere("10.89.1.7", A, str(table)) == 1
    assert pinned_elsewhere("10.89.1.9", B, str(table)) == 0
    assert pinned_elsewhere("10.89.1.7", B, str(tmp_path / "absent")) == 0


@contextlib.contextmanager
def migrating_while_draining(lab: Any, plan: Plan, addr: str) -> Iterator[dict[str, Any]]:
    """Run ``plan`` in a thread; the block runs once ``addr`` drains (``out["draining"]``, its route).
    Afterwards ``out["rec"]`` is the migration's record (its error, if any, is raised)."""
    lan = lab.agent("lan")
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["rec"] = migrate(lab, plan)
        except Exception as e:  # re-raised in the test's thread below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    try:
        out["draining"] = wait_for(
            lambda: [s for s in lan.get("/v1/routes") if s["dst"] == addr and s["draining"]],
            120,
            f"{addr} to drain",
            step=0.02,
        )[0]
        yield out
    finally:
        t.join(180)
    if "error" in out:
        raise out["error"]


@pytest.fixture
def nft_router(lab: Any) -> Iterator[Any]:
    lab.set_router("nft")
    try:
        yield lab
    finally:
        lab.set_router("route")


def lan_rules(lab: Any) -> tuple[str, str]:
    rules = lab.run("lan", ["ip", "rule"], check=False).stdout
    tables = lab.run("lan", ["nft", "list", "tables"], check=False).stdout
    return rules, tables


@pytest.mark.lab
def test_switching_routers_keeps_every_service_routed_and_leaves_nothing_behind(lab, workload):
    st = workload(heap_mb=16)
    lan = lab.agent("lan")
    probe = lan.post("/v1/probes", {"host": st["ip"], "port": 8000, "path": "/healthz", "interval": 0.02})["id"]
    wait_for(lambda: sum(r["ok"] for r in lan.get(f"/v1/probes/{probe}")) >= 5, 10, "probes answered")
    try:
        res = lab.set_router("nft")
        assert res["name"] == "nft"
        assert {"dst": st["ip"], "via": layout.node_ip("node-a"), "draining": False} in res["services"]
        rules, tables = lan_rules(lab)
        assert f"fwmark {hex(mark_of(layout.node_ip('node-a')))}" in rules and "table ip podmigrate" in tables
        # the route it replaced is gone: the map alone routes the service
        assert not [r for r in lan.get("/v1/routes") if r["dst"] == st["ip"] and "draining" not in r]
        assert lan.get(f"/v1/routes/{st['ip']}")["via"] == layout.node_ip("node-a")
    finally:
        back = lab.set_router("route")
    assert back["name"] == "route"
    assert {"dst": st["ip"], "via": layout.node_ip("node-a")} in back["services"]
    rules, tables = lan_rules(lab)
    assert "fwmark" not in rules and "podmigrate" not in tables
    records = lan.delete(f"/v1/probes/{probe}")
    failed = [r for r in records if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(records)} probes failed while the routers changed: {failed[:3]}"


@pytest.mark.lab
def test_a_restarted_lan_agent_keeps_the_router_and_its_services(nft_router, workload):
    lab = nft_router
    st = workload(heap_mb=16)
    old = lab.kill_service("lan", signal.SIGKILL)  # the lab holder restarts it
    wait_for(lambda: lab.service("lan") not in (None, old), 30, "a new LAN agent")

    def router() -> dict[str, Any] | None:
        try:
            return dict(lab.router())
        except PodmigrateError:
            return None

    res = wait_for(router, 30, "the new LAN agent to answer")
    assert res["name"] == "nft"
    assert {"dst": st["ip"], "via": layout.node_ip("node-a"), "draining": False} in res["services"]
    rules, tables = lan_rules(lab)
    assert tables.count("table ip podmigrate") == 1 and rules.count("fwmark") == 1, (rules, tables)


@pytest.mark.lab
def test_stop_copy_under_the_nft_router_carries_an_open_connection_without_draining(nft_router, workload):
    lab = nft_router
    st = workload(heap_mb=32)
    lan = lab.agent("lan")
    cid = hold_connection(lan, st["ip"])
    rec = migrate(lab, Plan(workload=st["name"], target="node-b", transport="stream"))
    assert rec["cutover"]["router"] == "nft"
    assert [s["draining"] for s in rec["cutover"]["switches"]] == [False]
    assert "drain" not in rec["cutover"]
    before = lan.get(f"/v1/connections/{cid}")["requests"]
    wait_for(
        lambda: lan.get(f"/v1/connections/{cid}")["requests"] >= before + 10,
        60,
        "requests over the same connection after the migration",
    )
    final = lan.delete(f"/v1/connections/{cid}")
    assert final["error"] is None and final["same_connection"] and not final["counter_went_backwards"], final
    assert lan.get(f"/v1/routes/{st['ip']}")["via"] == layout.node_ip("node-b")


@pytest.mark.lab
def test_decoupled_under_the_nft_router_lets_a_connection_open_at_the_cutover_finish_on_the_source(
    nft_router, workload
):
    lab = nft_router
    st = workload(heap_mb=32)
    lan = lab.agent("lan")
    cid = hold_connection(lan, st["ip"])
    plan = Plan(workload=st["name"], target="node-b", mode="decoupled", transport="stream", drain_timeout=4)
    try:
        with migrating_while_draining(lab, plan, st["ip"]) as result:
            # new connections already reach the copy on node-b, while the open one is held by node-a
            assert result["draining"]["via"] == layout.node_ip("node-b")
            during = lan.get(f"/v1/connections/{cid}")
            after = wait_for(
                lambda: (c := lan.get(f"/v1/connections/{cid}"))["requests"] >= during["requests"] + 10 and c,
                30,
                "requests over the open connection while draining",
            )
            assert after["error"] is None and after["same_connection"] and not after["counter_went_backwards"], after
            assert lan.get(f"/v1/routes/{st['ip']}")["via"] == layout.node_ip("node-b")
    finally:
        lan.delete(f"/v1/connections/{cid}")
    rec = result["rec"]
    assert rec["state"] == "kept" and rec["checks"]["sha256_equal"]
    # the keep-alive connection never ends by itself: the drain waited its full deadline, then cut it
    (drain,) = rec["cutover"]["drain"]
    assert drain["forced"] and drain["open"] >= 1 and drain["drained_s"] >= 3.5, drain
    assert not [s for s in lan.get("/v1/routes") if s["dst"] == st["ip"] and s["draining"]]


@pytest.mark.lab
def test_a_pod_moves_decoupled_and_a_connection_through_its_sidecar_finishes_on_the_source(nft_router, workload):
    lab = nft_router
    st = workload(heap_mb=16, sidecar=True)
    pod = st["name"].removesuffix("-server")
    lan = lab.agent("lan")
    cid = hold_connection(lan, st["ip"])
    try:
        with migrating_while_draining(
            lab, Plan(workload=pod, target="node-b", mode="decoupled", drain_timeout=4), st["ip"]
        ) as result:
            during = lan.get(f"/v1/connections/{cid}")
            after = wait_for(
                lambda: (c := lan.get(f"/v1/connections/{cid}"))["requests"] >= during["requests"] + 10 and c,
                30,
                "requests through the source pod's sidecar while draining",
            )
            assert after["error"] is None and after["same_connection"] and not after["counter_went_backwards"], after
    finally:
        lan.delete(f"/v1/connections/{cid}")
    rec = result["rec"]
    assert rec["scope"] == "pod" and rec["mode"] == "decoupled"
    assert rec["checks"]["sha256_equal"] and rec["checks"]["same_process_start"]
    assert rec["drift"]["counter"] is not None and rec["drift"]["counter"] >= 0
    assert rec["blackout"]["at_cutover"]["failed"] == 0, rec["blackout"]  # handshakes drained on the source
    # the copy answers at the pod's address, through its own sidecar
    assert manage.state(lab, pod)["node"] == "node-b"
    for node, ctrs in manage.inventory(lab).items():  # nothing of the pod left on the source
        assert node == "node-b" or not [c for c in ctrs if c["name"].startswith(pod)]


@pytest.mark.lab
def test_the_nft_router_runs_nftables_in_the_lan_agents_own_process(nft_router):
    """libnftables through ctypes (routing.libnft), not a started nft: the switch is inside the blackout."""
    code = (
        "import json; from podmigrate.routing import libnft; "
        "data = json.loads(libnft.run('list map ip podmigrate owner', json=True)); "
        "print(libnft._nft is not None, any('map' in o for o in data['nftables']))"
    )
    out = nft_router.run("lan", ["env", "PYTHONPATH=/opt/podmigrate", "python3", "-c", code]).stdout
    assert out.split() == ["True", "True"], out
    # nft's own error comes back as a RoutingError naming the command
    bad = "from podmigrate.routing import libnft; libnft.run('list table ip no-such-table')"
    p = nft_router.run("lan", ["env", "PYTHONPATH=/opt/podmigrate", "python3", "-c", bad], check=False)
    assert p.returncode != 0 and "RoutingError: nft 'list table ip no-such-table' failed" in p.stderr, p.stderr
