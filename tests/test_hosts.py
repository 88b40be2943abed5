"""Hosts that are not the lab: the inventory's checks, ``hosts init``'s identities and bundles,
``hosts install-agent``, and a real node agent started from a bundle, reached over TCP on loopback
with certificates only (no lab, no token)."""

from __future__ import annotations

import os
import random
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from podmigrate.client import AgentClient
from podmigrate.engine.cluster import Cluster
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.hosts import agent_unit, identities, inventory
from podmigrate.hosts.cluster import Hosts, LocalObserver
from podmigrate.pki import CA

from .conftest import wait_for

TWO = "[hosts.a]\naddress = '192.0.2.1'\n[hosts.b]\naddress = '192.0.2.2'\n"
GOOD = """
registry = "registry.example:5000"
router = "l2"
network = "seg"

[hosts.host-a]
address = "{a}"

[hosts.host-b]
address = "{b}"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "hosts.toml"
    p.write_text(text)
    return p


def test_an_inventory_names_its_hosts_and_defaults_the_rest(tmp_path: Path) -> None:
    inv = inventory.load(write(tmp_path, GOOD.format(a="192.0.2.11", b="192.0.2.12")))
    assert [(h.name, h.address) for h in inv.hosts] == [("host-a", "192.0.2.11"), ("host-b", "192.0.2.12")]
    assert (inv.registry, inv.router, inv.network) == ("registry.example:5000", "l2", "seg")
    assert inv.state == tmp_path / "hosts.state"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[hosts.a]\naddress = '192.0.2.1'\n", "fewer than two [hosts.NAME] tables"),
        ("router = 'l2'\n" + TWO, "router l2 moves addresses on a segment the hosts share"),
        ("[hosts.a]\naddress = '192.0.2.1'\n[hosts.b]\naddress = 'b.example'\n", "address 'b.example' is not an IP"),
        ("[hosts.a]\naddress = '192.0.2.1'\n[hosts.b]\naddress = '192.0.2.1'\n", "two hosts have one address"),
        (
            "[hosts.a]\naddress = '192.0.2.1'\nport = 1\n[hosts.b]\naddress = '192.0.2.2'\n",
            "[hosts.a] has unknown keys ['port']",
        ),
        (
            "[hosts.'../a']\naddress = '192.0.2.1'\n[hosts.b]\naddress = '192.0.2.2'\n",
            "host name '../a' is not a valid name",
        ),
        ("router = 'bgp'\n" + TWO, "router 'bgp'"),
        (
            "registry = 'r.example/x'\n[hosts.a]\naddress = '192.0.2.1'\n[hosts.b]\naddress = '192.0.2.2'\n",
            "is not host:port",
        ),
        ("host = 1\n", "unknown keys ['host']"),
        (TWO.replace("'192.0.2.2'", "'2001:db8::2'"), "is not an IPv4 address"),
        (TWO.replace("[hosts.b]", "[hosts.podmigrate-controller]"), "'podmigrate-controller' is the controller's"),
        ("[hosts\n", "is not TOML"),
    ],
)
def test_a_wrong_inventory_is_refused_saying_where_and_what_to_write(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(UsageError) as e:
        inventory.load(write(tmp_path, text))
    assert said in e.value.message and str(tmp_path / "hosts.toml") in e.value.message and e.value.hint
    assert not (tmp_path / "hosts.state").exists()  # nothing made


def test_init_makes_each_hosts_bundle_once_and_keeps_it(tmp_path: Path) -> None:
    inv = inventory.load(write(tmp_path, GOOD.format(a="192.0.2.11", b="192.0.2.12")))
    bundles = identities.init(inv)
    b = bundles["host-b"]
    assert sorted(p.name for p in b.iterdir()) == ["agent.crt", "agent.env", "agent.key", "ca.crt"]
    assert (b.stat().st_mode & 0o777, (b / "agent.key").stat().st_mode & 0o777) == (0o700, 0o600)
    cert = x509.load_pem_x509_certificate((b / "agent.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["192.0.2.12"]
    env = (b / "agent.env").read_text()
    for arg in ("--name host-b", "--tcp 192.0.2.12:7070", "--peer host-a", "--controller podmigrate-controller",
                "--node-address host-a=192.0.2.11", "--node-address host-b=192.0.2.12"):  # fmt: skip
        assert arg in env
    before = (b / "agent.crt").read_bytes()
    identities.init(inv)  # again: what is still valid is kept
    assert (b / "agent.crt").read_bytes() == before
    # a host given another address gets a certificate for it (the old one would fail every handshake)
    moved = inventory.load(write(tmp_path, GOOD.format(a="192.0.2.11", b="192.0.2.13")))
    b = identities.init(moved)["host-b"]
    cert = x509.load_pem_x509_certificate((b / "agent.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["192.0.2.13"]


def test_a_relative_state_directory_is_beside_the_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    inv = inventory.load(write(tmp_path, 'state = "run/state"\n' + TWO))
    assert inv.state == tmp_path / "run/state"


def test_install_agent_puts_the_bundle_and_the_unit_in_place(tmp_path: Path) -> None:
    inv = inventory.load(write(tmp_path, GOOD.format(a="192.0.2.11", b="192.0.2.12")))
    bundle = identities.init(inv)["host-a"]
    root = tmp_path / "root"
    agent_unit.install(bundle, root)
    etc = root / "etc/podmigrate"
    assert (etc.stat().st_mode & 0o777, (etc / "agent.key").stat().st_mode & 0o777) == (0o700, 0o600)
    assert (etc / "agent.env").read_text() == (bundle / "agent.env").read_text()
    unit = (root / "etc/systemd/system/podmigrate-agent.service").read_text()
    assert f"ExecStart={sys.executable} -m podmigrate.agent.server $PODMIGRATE_AGENT_ARGS" in unit
    assert "EnvironmentFile=/etc/podmigrate/agent.env" in unit
    (tmp_path / "half").mkdir()
    for f in ("ca.crt", "agent.crt"):
        (tmp_path / "half" / f).write_text("x")
    with pytest.raises(UsageError, match=r"agent\.key, agent\.env missing"):
        agent_unit.install(tmp_path / "half", root)


def test_a_hosts_agent_lets_in_its_controller_and_hands_peers_only_checkpoints(tmp_path: Path) -> None:
    """Started with the bundle's own arguments (TCP only, no token), on loopback addresses of its own."""
    net = f"127.{random.randint(64, 250)}.{os.getpid() % 250}"
    inv = inventory.load(write(tmp_path, GOOD.format(a=f"{net}.11", b=f"{net}.12")))
    bundle = identities.init(inv)["host-a"]
    argv = [sys.executable, "-m", "podmigrate.agent.server", *identities.agent_args(inv, "host-a", bundle)]
    agent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ca = CA(inv.state / "pki", f"hosts {inv.path.stem}")

    def client(tls: ssl.SSLContext) -> AgentClient:
        return AgentClient("host-a", None, "", 5, base_url=f"https://{net}.11:7070", tls=tls)

    try:
        controller = client(identities.controller(inv).client_context())

        def answers() -> object:
            try:
                return controller.get("/v1/notice")
            except PodmigrateError:
                assert agent.poll() is None, agent.stdout.read() if agent.stdout else ""
                return None

        assert wait_for(answers, 30, "the agent to answer its controller") == {"instance_action": None}
        peer = client(ca.issue("host-b", ips=[f"{net}.12"]).client_context())
        with pytest.raises(PodmigrateError, match=r"GET /v1/notice is not open to peers \('host-b'\)"):
            peer.get("/v1/notice")
        intruder = client(ca.issue("host-z").client_context())  # this CA's, but no host of the inventory
        with pytest.raises(PodmigrateError, match=r"certificate 'host-z' is not one of its peers"):
            intruder.get("/v1/notice")
        # the controller's name, from another CA: the agent ends the handshake
        foreign = CA(tmp_path / "other-pki", "other").issue(inventory.CONTROLLER)
        tls = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca.cert_path))
        tls.load_cert_chain(str(foreign.cert), str(foreign.key))
        stranger = client(tls)
        with pytest.raises(PodmigrateError, match="unreachable"):
            stranger.get("/v1/notice")
        for c in (controller, peer, intruder, stranger):
            c.close()
        # the controller's view of the inventory: host-a answers, host-b (no agent started) does not
        hosts: Cluster = Hosts(inv)
        st = Hosts(inv).status()
        assert st["host-a"]["up"], st
        assert (st["host-a"]["up"], st["host-a"]["name"], st["host-a"]["ip"]) == (True, "host-a", f"{net}.11")
        assert (st["host-b"]["up"], st["host-b"]["address"]) == (False, f"{net}.12")
        with pytest.raises(PodmigrateError, match=r"agents not answering: host-b \(agent host-b unreachable"):
            hosts.require_up()
    finally:
        agent.kill()
        agent.wait()


def test_hosts_refuse_what_is_not_there_before_anything_moves(tmp_path: Path) -> None:
    inv = inventory.load(write(tmp_path, GOOD.format(a="192.0.2.11", b="192.0.2.12")))
    hosts = Hosts(inv)
    assert (hosts.nodes, hosts.node_address("host-b"), hosts.registry) == (
        ["host-a", "host-b"], "192.0.2.12", "registry.example:5000")  # fmt: skip
    assert hosts.moves_addresses and type(hosts.traffic()).__name__ == "L2Router"
    with pytest.raises(UsageError, match="router static names no router") as e:
        inventory.load(write(tmp_path, 'router = "static"\n' + TWO))
    assert "[router]" in (e.value.hint or "")
    with pytest.raises(UsageError, match="no host 'host-c'"):
        hosts.agent("host-c")
    with pytest.raises(UsageError, match=r"no controller identity in .*pki"):
        hosts.agent("host-a")  # `hosts init` not run yet
    bare = Hosts(inventory.load(write(tmp_path, TWO)))
    with pytest.raises(UsageError, match="names no registry") as e:
        _ = bare.registry
    assert "--transport stream" in (e.value.hint or "")
    assert bare.traffic().switch("10.88.0.5", "b")["router"] == "none" and not bare.moves_addresses


def test_the_controller_observes_from_where_it_runs(tmp_path: Path) -> None:
    """A real HTTP server on loopback, read and probed at 50 Hz by the controller itself."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"counter": 1}' if self.path == "/state" else b"ok"
            self.send_response(200 if self.path in ("/state", "/healthz") else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    obs = LocalObserver()
    try:
        got = obs.get(f"http://127.0.0.1:{port}/state", timeout=5)
        assert (got["ok"], got["status"], got["body"]) == (True, 200, '{"counter": 1}')
        assert obs.get(f"http://127.0.0.1:{port}/nothing", timeout=5)["status"] == 404
        with pytest.raises(UsageError, match="http:// URLs only"):
            obs.get("file:///etc/passwd")
        pid = obs.start_probe({"host": "127.0.0.1", "port": port, "path": "/healthz", "interval": 0.02})
        wait_for(lambda: len([r for r in obs.probe_records(pid) if r["ok"]]) >= 5, 30, "five answered probes")
        recs = obs.stop_probe(pid)
        assert len(recs) >= 5 and all(r["ok"] for r in recs if not r.get("pending"))
        with pytest.raises(UsageError, match=f"no probe {pid}"):
            obs.probe_records(pid)
        server.shutdown()
        server.server_close()
        refused = obs.get(f"http://127.0.0.1:{port}/state", timeout=5)
        assert refused["ok"] is False and "ConnectionRefused" in refused["error"]
    finally:
        obs.close()
        server.server_close()


def test_a_static_router_is_named_by_its_agent_and_gets_a_bundle(tmp_path: Path) -> None:
    inv = inventory.load(write(tmp_path, TWO + '[router]\naddress = "192.0.2.254"\n'))
    assert (inv.router, inv.router_address) == ("static", "192.0.2.254")
    bundles = identities.init(inv)
    assert sorted(bundles) == ["a", "b", "router"]
    args = identities.agent_args(inv, "router")
    assert args[:4] == ["--role", "lan", "--name", "router"] and "192.0.2.254:7070" in args
    assert "--controller" in args and "--peer" not in args  # routes for the controller only
    hosts = Hosts(inv)
    assert hosts.moves_addresses and not hosts.shared_segment
    assert type(hosts.traffic()).__name__ == "LanClient"
    with pytest.raises(UsageError, match=r"\[router\] address 'x' is not an IPv4 address"):
        inventory.load(write(tmp_path, TWO + '[router]\naddress = "x"\n'))
