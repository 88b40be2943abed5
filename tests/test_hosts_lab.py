"""Hosts that are not the lab's own cluster, for real: the nodes of a lab whose Podman has its NAT and
published ports on (``lab up --firewall nftables``), set up as docs/hosts.md sets up machines
(``hosts_installed``: addresses of their own, ``hosts init``, the agent installed with ``hosts
install-agent`` and started as its systemd unit) and reached only through that inventory: the
controller runs ``podmigrate --hosts`` from the lab's LAN, talks to those agents over TCP with its
certificate, and probes the workload at its host's published port.
A container started as a user starts one (``podman run -d -p 8080:8000``, Podman's default network)
moves with its heap and process, and answers at the target's address afterwards. With the ``l2``
router a container on a macvlan of the LAN's segment keeps its address, and a client's open TCP
connection goes on over the same connection."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podmigrate.lab import hosts_view
from podmigrate.lab.cluster import Lab
from podmigrate.workload.image import workload_image

from .conftest import hold_connection, run_lab_name, up_lab, wait_for
from .hosts_installed import SECOND, Installed, install

pytestmark = pytest.mark.lab

PODMIGRATE = str(Path(sys.executable).parent / "podmigrate")


@pytest.fixture(scope="module")
def hosts_lab() -> Iterator[Lab]:
    yield from up_lab(run_lab_name("hosts"), firewall="nftables")


@pytest.fixture(scope="module")
def hosts(hosts_lab: Lab) -> Iterator[Installed]:
    """The nodes with agents installed from ``hosts init``'s bundles, all answering the controller."""
    lab = hosts_lab

    def answering(inventory: Path) -> dict[str, Any] | None:
        p = on_lan(lab, "hosts", "status", str(inventory), "--json")
        st: dict[str, Any] = json.loads(p.stdout) if p.stdout.startswith("{") else {}
        return st if st and all(h["up"] for h in st.values()) else None

    with install(lab, lambda inv: on_lan(lab, "hosts", "init", str(inv))) as inst:
        st = wait_for(lambda: answering(inst.inventory("static")), 60, "the installed agents to answer")
        assert {n: h["address"] for n, h in st.items() if n in SECOND} == SECOND, st
        assert st["router"]["role"] == "lan", st
        yield inst


def on_lan(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    """``podmigrate ARGS`` from the lab's LAN, as on a user's controller machine."""
    argv = hosts_view.lan_argv(lab, [PODMIGRATE, *args])
    wide = {**os.environ, "COLUMNS": "1000"}  # messages on one line each, as they are matched
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=wide)


def controller(lab: Lab, inventory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``podmigrate --hosts INVENTORY ARGS`` from the lab's LAN."""
    return on_lan(lab, "--hosts", str(inventory), *args)


def state(lab: Lab, endpoint: str) -> dict[str, Any] | None:
    p = lab.run("lan", ["curl", "-s", "--max-time", "3", f"http://{endpoint}/state"], check=False)
    try:
        return dict(json.loads(p.stdout)) if p.returncode == 0 else None
    except ValueError:
        return None


def containers(lab: Lab, node: str) -> list[str]:
    return lab.run(node, ["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()


def test_a_published_container_moves_between_hosts_and_answers_at_its_new_address(hosts: Installed) -> None:
    lab = hosts.lab
    inventory = hosts.inventory()
    a, b = (f"{SECOND[n]}:8080" for n in ("node-a", "node-b"))
    lab.run("node-a", ["podman", "rm", "-f", "-t", "0", "web"], check=False)
    lab.run("node-a", ["podman", "run", "-d", "--name", "web", "-p", "8080:8000", "-e", "HEAP_MB=16", workload_image()])
    try:
        before = wait_for(lambda: state(lab, a), 60, "the container to answer at node-a's published port")
        moved = controller(lab, inventory, "migrate", "web", "--to", "node-b", "--transport", "stream",
                           "--probe", "http:8000/healthz", "--json")  # fmt: skip
        assert moved.returncode == 0, moved.stderr + moved.stdout
        rec = json.loads(moved.stdout)
        assert (rec["status"], rec["answers_at"], rec["keep_address"]) == ("completed", [b], False)
        assert rec["blackout_method"] == "probe" and rec["security"]["controller"].startswith("mutual TLS")
        assert "closed" in rec["tcp"]
        after = state(lab, b)
        assert after is not None and after["sha256"] == before["sha256"] and after["started"] == before["started"]
        assert after["counter"] >= before["counter"]
        assert state(lab, a) is None  # nothing answers at the source any more
        assert "web" not in containers(lab, "node-a") and "web" in containers(lab, "node-b")

        back = controller(lab, inventory, "migrate", "web", "--to", "node-a", "--mode", "lazy",
                          "--probe", "http:8000/healthz", "--json")  # fmt: skip
        assert back.returncode == 0, back.stderr + back.stdout
        assert json.loads(back.stdout)["answers_at"] == [a]
        again = state(lab, a)
        assert again is not None and (again["sha256"], again["started"]) == (before["sha256"], before["started"])
        history = controller(lab, inventory, "history", "--json")
        assert [r["workload"] for r in json.loads(history.stdout)[:2]] == ["web", "web"]
    finally:
        for node in lab.nodes:
            lab.run(node, ["podman", "rm", "-f", "-t", "0", "web"], check=False)


def test_what_cannot_follow_to_another_host_is_refused_before_anything_is_frozen(hosts_lab: Lab) -> None:
    """Through the lab's own agents as hosts (``lab inventory``)."""
    lab = hosts_lab
    inventory = hosts_view.inventory(lab)
    pinned = f"{lab.node_address('node-a')}:8081"
    lab.run("node-a", ["podman", "rm", "-f", "-t", "0", "pinned"], check=False)
    lab.run("node-a", ["podman", "run", "-d", "--name", "pinned", "-p", f"{pinned}:8000", "-e", "HEAP_MB=8",
                       workload_image()])  # fmt: skip
    try:
        before = wait_for(lambda: state(lab, pinned), 60, "the pinned container to answer")
        refused = controller(lab, inventory, "migrate", "pinned", "--to", "node-b")
        assert refused.returncode != 0
        assert "publishes ports on its host's own address" in refused.stderr, refused.stderr
        cold = controller(lab, inventory, "migrate", "pinned", "--to", "node-b", "--mode", "cold")
        assert "mode 'cold' is not built for clusters whose router moves no address" in cold.stderr, cold.stderr
        after = state(lab, pinned)  # the same process serves on, never frozen
        assert after is not None and after["started"] == before["started"] and after["counter"] >= before["counter"]
        assert "pinned" not in containers(lab, "node-b")
    finally:
        lab.run("node-a", ["podman", "rm", "-f", "-t", "0", "pinned"], check=False)


def carried_on(lan: Any, cid: str, when: str) -> None:
    """The held connection carries ten more requests, or the test fails with what happened to it."""
    served = lan.get(f"/v1/connections/{cid}")["requests"]

    def more() -> dict[str, Any] | None:
        st: dict[str, Any] = lan.get(f"/v1/connections/{cid}")
        return st if st["requests"] >= served + 10 or st["error"] else None

    st = wait_for(more, 60, f"requests over the same connection {when}")
    assert st["error"] is None and st["same_connection"] and not st["counter_went_backwards"], (when, st)


SEGMENT = ["-d", "macvlan", "-o", "parent=eth0", "--subnet", "10.77.0.0/24", "--gateway", "10.77.0.1"]


def test_on_a_shared_segment_the_address_and_an_open_connection_move_with_the_container(hosts: Installed) -> None:
    lab = hosts.lab
    for node in lab.nodes:  # the segment's network, made on each host as its user would
        if lab.run(node, ["podman", "network", "exists", "seg"], check=False).returncode:
            lab.run(node, ["podman", "network", "create", *SEGMENT, "--ip-range", "10.77.0.224/28", "seg"])
    inventory = hosts.inventory("l2", "seg")
    ip = "10.77.0.230"
    lab.run("node-a", ["podman", "rm", "-f", "-t", "0", "l2web"], check=False)
    lab.run("node-a", ["podman", "run", "-d", "--name", "l2web", "--network", "seg", "--ip", ip, "-e", "HEAP_MB=16",
                       workload_image()])  # fmt: skip
    lan = lab.agent("lan")  # the test's own client on the LAN: a keep-alive connection, 20 requests a second
    try:
        before = wait_for(lambda: state(lab, f"{ip}:8000"), 60, "the container to answer on the segment")
        cid = hold_connection(lan, ip)
        decoupled = controller(lab, inventory, "migrate", "l2web", "--to", "node-b", "--mode", "decoupled")
        assert "a copy made while it serves would compete with it for its address" in decoupled.stderr
        moved = controller(lab, inventory, "migrate", "l2web", "--to", "node-b", "--transport", "stream",
                           "--probe", "http:8000/healthz", "--json")  # fmt: skip
        assert moved.returncode == 0, moved.stderr + moved.stdout
        rec = json.loads(moved.stdout)
        assert rec["status"] == "completed" and rec["service_addresses"] == [ip] and "answers_at" not in rec
        (switch,) = rec["cutover"]["switches"]
        assert (switch["router"], switch["node"], switch["withdrawn"]) == ("l2", "node-b", ["l2web"])
        after = state(lab, f"{ip}:8000")
        assert after is not None and (after["sha256"], after["started"]) == (before["sha256"], before["started"])
        carried_on(lan, cid, "after the migration")
        assert "l2web" not in containers(lab, "node-a")
        back = controller(lab, inventory, "migrate", "l2web", "--to", "node-a", "--mode", "lazy", "--json")
        assert back.returncode == 0, back.stderr + back.stdout
        assert json.loads(back.stdout)["speculative"]["state"] == "not used"  # no early copy on the segment
        carried_on(lan, cid, "after the way back")
        final = lan.delete(f"/v1/connections/{cid}")
        assert final["error"] is None and final["same_connection"] and not final["counter_went_backwards"], final
    finally:
        lan.close()
        for node in lab.nodes:
            lab.run(node, ["podman", "rm", "-f", "-t", "0", "l2web"], check=False)


ROUTED = "10.90.7.0/24"  # the hosts' routed subnet: a bridge of the same gateway on each, no NAT


@contextlib.contextmanager
def routed_network(lab: Lab) -> Iterator[None]:
    """Each host's end of a routed subnet as docs/hosts.md sets one up: a bridge with the subnet's
    gateway and a Podman network on it that Podman leaves alone (``mode=unmanaged``: no masquerade,
    which would rewrite a restored connection's packets); the router sends the subnet to node-a."""
    for node in lab.nodes:  # the network before the bridge: Podman refuses a subnet the host has already
        if lab.run(node, ["podman", "network", "exists", "routed"], check=False).returncode:
            lab.run(node, ["podman", "network", "create", "--interface-name", "rbr0", "-o", "mode=unmanaged",
                           "--subnet", ROUTED, "--gateway", "10.90.7.1", "--disable-dns", "routed"])  # fmt: skip
        lab.run(node, ["sh", "-c", "ip link show rbr0 >/dev/null 2>&1 || { ip link add rbr0 type bridge && "
                                   "ip addr add 10.90.7.1/24 dev rbr0 && ip link set rbr0 up; }"])  # fmt: skip
    lab.run("lan", ["ip", "route", "replace", ROUTED, "via", SECOND["node-a"]])
    try:
        yield
    finally:
        lab.run("lan", ["ip", "route", "del", ROUTED], check=False)


def test_with_a_static_router_the_address_and_an_open_connection_move_to_the_new_host(hosts: Installed) -> None:
    """The router the inventory names (its agent in the LAN): a /32 route to the target's address."""
    lab = hosts.lab
    inventory = hosts.inventory("static", "routed")
    ip = "10.90.7.200"
    with routed_network(lab):
        lab.run("node-a", ["podman", "rm", "-f", "-t", "0", "routed"], check=False)
        lab.run("node-a", ["podman", "run", "-d", "--name", "routed", "--network", "routed", "--ip", ip,
                           "-e", "HEAP_MB=8", workload_image()])  # fmt: skip
        lan = lab.agent("lan")  # the test's client on the LAN, whose packets the router sends on
        try:
            before = wait_for(lambda: state(lab, f"{ip}:8000"), 60, "the container to answer at its address")
            cid = hold_connection(lan, ip)
            moved = controller(lab, inventory, "migrate", "routed", "--to", "node-b", "--transport", "stream",
                               "--probe", "http:8000/healthz", "--json")  # fmt: skip
            assert moved.returncode == 0, moved.stderr + moved.stdout
            rec = json.loads(moved.stdout)
            (switch,) = rec["cutover"]["switches"]
            assert (switch["addr"], switch["via"]) == (ip, SECOND["node-b"]), switch
            after = state(lab, f"{ip}:8000")
            assert after is not None and (after["sha256"], after["started"]) == (before["sha256"], before["started"])
            carried_on(lan, cid, "after the migration")
            assert "routed" not in containers(lab, "node-a")
            final = lan.delete(f"/v1/connections/{cid}")
            assert final["error"] is None and final["same_connection"] and not final["counter_went_backwards"], final
        finally:
            lan.close()
            for node in lab.nodes:
                lab.run(node, ["podman", "rm", "-f", "-t", "0", "routed"], check=False)
            lab.agent("lan").delete(f"/v1/routes/{ip}")
