"""The attacks of the security issue, tried for real inside a lab: from a workload container, from a
peer without the lab's certificate, at a CRIU page server, and with names and URLs made to be misread.
Each has a positive control beside it, so that a test that could not fail would show."""

from __future__ import annotations

import json
import textwrap
import uuid
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import TransportError, UsageError
from podmigrate.lab import guard as node_guard
from podmigrate.transport import seal
from podmigrate.transport.registry import checkpoint_annotations
from podmigrate.workload import manage

from .conftest import wait_for

pytestmark = pytest.mark.lab

CONNECT = textwrap.dedent(
    """
    import json, socket, sys
    out = {}
    for target in json.loads(sys.argv[1]):
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            out[target] = "connected"
        except OSError as e:
            out[target] = type(e).__name__
    print(json.dumps(out))
    """
)


def _connect_from_container(lab: Any, node: str, name: str, targets: list[str]) -> dict[str, str]:
    p = lab.run(node, ["podman", "exec", name, "python3", "-c", CONNECT, json.dumps(targets)], timeout=60)
    result: dict[str, str] = json.loads(p.stdout)
    return result


def test_a_workload_cannot_open_a_connection_to_agents_page_servers_or_the_registry(lab: Any, workload: Any) -> None:
    mine = workload(node="node-a")
    port = layout.AGENT_PORT
    forbidden = [
        f"{layout.node_ip('node-a')}:{port}",  # its own node's agent
        f"{layout.WORKLOAD_GATEWAY}:{port}",  # the same agent through the bridge's address
        f"{layout.node_ip('node-b')}:{port}",  # another node's agent
        f"{layout.LAN_GATEWAY}:{port}",  # the LAN agent
        layout.REGISTRY,  # the registry
    ]
    got = _connect_from_container(lab, "node-a", mine["name"], forbidden)
    assert got == {t: "TimeoutError" for t in forbidden}
    # the control: without the nodes' guard tables the same container reaches them (the bridge's
    # address has no agent: refused, i.e. reached). Another node's agent stays out of reach by routing
    # as well (every node has the workload /16 on its own bridge, so replies never leave it); the guard
    # is what keeps it so if the routing changes.
    for n in ("node-a", "node-b"):
        lab.run(n, ["nft", "delete", "table", "inet", "podmigrate_guard"])
    try:
        got = _connect_from_container(lab, "node-a", mine["name"], forbidden)
    finally:
        for n in ("node-a", "node-b"):
            lab.run(n, ["nft", "-f", "-"], input=node_guard.rules())
    expect = {t: "connected" for t in forbidden}
    expect[f"{layout.WORKLOAD_GATEWAY}:{port}"] = "ConnectionRefusedError"
    expect[f"{layout.node_ip('node-b')}:{port}"] = "TimeoutError"
    assert got == expect
    # and a page server: one is listening on node-b while this runs
    cid = f"sec-{uuid.uuid4().hex[:6]}"
    b = lab.agent("node-b")
    ps = b.post(f"/v1/checkpoints/{cid}/page-server")
    try:
        got = _connect_from_container(lab, "node-a", mine["name"], [f"{ps['address']}:{ps['port']}"])
        assert got == {f"{ps['address']}:{ps['port']}": "TimeoutError"}
    finally:
        b.delete(f"/v1/checkpoints/{cid}")


TLS_CLIENT = textwrap.dedent(
    """
    import json, socket, ssl, sys
    host, port, cert = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ctx = ssl.create_default_context(cafile="/var/lib/podmigrate-lab/pki/ca.crt")
    ctx.check_hostname = False  # CRIU's page server certificate names the node, the test checks the client
    if cert:
        ctx.load_cert_chain(f"/var/lib/podmigrate-lab/pki/{cert}.crt", f"/var/lib/podmigrate-lab/pki/{cert}.key")
    # TLS 1.3: a client's handshake ends before the server has judged the client's certificate; a
    # refusal arrives as an alert or a hang-up on the first read
    try:
        with socket.create_connection((host, port), timeout=5) as raw, ctx.wrap_socket(raw) as s:
            if sys.argv[4]:
                s.sendall(sys.argv[4].encode())
            s.settimeout(3)
            data = b""
            try:
                while chunk := s.recv(65536):  # an agent's answer ends with the connection
                    data += chunk
            except TimeoutError:
                if not data:
                    data = None  # a page server waits for commands
            if data is None:
                print(json.dumps({"open": True, "answer": ""}))
            else:
                print(json.dumps({"open": bool(data), "answer": data.decode(errors="replace")}))
    except (OSError, ssl.SSLError) as e:
        print(json.dumps({"open": False, "error": f"{type(e).__name__}: {e}"}))
    """
)


def _tls(lab: Any, node: str, host: str, port: int, cert: str, send: str = "") -> dict[str, Any]:
    p = lab.run(node, ["python3", "-c", TLS_CLIENT, host, str(port), cert, send], timeout=60)
    result: dict[str, Any] = json.loads(p.stdout)
    return result


def test_an_agent_port_gives_nothing_to_a_peer_without_a_lab_certificate_even_with_the_token(lab: Any) -> None:
    host = layout.node_ip("node-a")
    request = (
        f"GET /v1/info HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {lab.token()}\r\nConnection: close\r\n\r\n"
    )
    stranger = _tls(lab, "node-b", host, layout.AGENT_PORT, "", request)
    assert not stranger["open"] and not stranger.get("answer"), stranger
    # another node's certificate opens the port, but only for handing over a checkpoint: it may not
    # read the agent, give it a key, or make it send anything anywhere
    for method, path in (("GET", "/v1/info"), ("POST", "/v1/checkpoints/x1/seal"), ("POST", "/v1/checkpoints/x1/send")):
        ask = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        peer = _tls(lab, "node-b", host, layout.AGENT_PORT, "node-b", ask)
        assert peer["open"] and peer["answer"].split(" ", 2)[1] == "403", peer
        assert "is not open to peers ('node-b')" in peer["answer"], peer
    # over plain TCP the agent does not speak at all
    plain = lab.run("node-b", ["curl", "-s", "-m", "5", f"http://{host}:{layout.AGENT_PORT}/v1/info"], check=False)
    assert plain.returncode != 0 and "node-a" not in plain.stdout


def test_a_criu_page_server_takes_pages_only_from_a_peer_with_a_lab_certificate(lab: Any) -> None:
    b = lab.agent("node-b")
    for cert, expect in (("", False), ("node-a", True)):
        cid = f"sec-{uuid.uuid4().hex[:6]}"
        ps = b.post(f"/v1/checkpoints/{cid}/page-server")
        try:
            got = _tls(lab, "node-a", ps["address"], ps["port"], cert)
            assert got["open"] is expect, got
            log = lab.dir / "nodes" / "node-b" / "checkpoints" / f"{cid}.pages" / "page-server.log"
            wait_for(lambda: log.exists() and "tls:" in log.read_text(errors="replace"), 20, "the page server's log")  # noqa: B023
            text = log.read_text(errors="replace")
            # past TLS, CRIU reads the page map: only a peer with a certificate gets that far
            assert ("page-xfer" in text) is expect, text[-2000:]
            assert ("TLS handshake failed: Certificate is required" in text) is not expect, text[-2000:]
        finally:
            b.delete(f"/v1/checkpoints/{cid}")


STRANGER = textwrap.dedent(
    """
    import os, socket, struct, sys
    # the seal's header and a frame made up without the migration's key
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
        s.sendall(b"PMSEAL1\\n" + os.urandom(16) + struct.pack(">I", 64) + os.urandom(64))
        s.settimeout(10)
        print(repr(s.recv(100)))
    """
)


def test_a_relayed_page_server_listens_on_loopback_and_its_relay_drops_a_peer_without_the_key(lab: Any) -> None:
    b = lab.agent("node-b")
    cid = f"sec-{uuid.uuid4().hex[:6]}"
    ps = b.post(f"/v1/checkpoints/{cid}/page-server", {"relay": True, "seal": seal.new_key()})
    try:
        assert ps["relay"] is True and ps["address"] == layout.node_ip("node-b")
        # CRIU's own page server listens on node-b's loopback only: the LAN sees the relay, nothing else
        listening = lab.run("node-b", ["ss", "-Hltnp"]).stdout
        criu = [ln for ln in listening.splitlines() if '"criu"' in ln]
        assert len(criu) == 1 and " 127.0.0.1:" in criu[0], listening
        assert f"{ps['address']}:{ps['port']} " in listening
        got = lab.run("node-a", ["python3", "-c", STRANGER, ps["address"], str(ps["port"])], timeout=60)
        assert got.stdout.strip() == "b''", got.stdout  # hung up on, told nothing
        log = lab.dir / "logs" / "node-b.log"
        wait_for(lambda: f"page relay {cid}: dropped" in log.read_text(errors="replace"), 20, "the relay's log line")
        assert "frame 0 does not authenticate" in log.read_text(errors="replace").split(f"page relay {cid}: dropped")[1]
        # still waiting for the real source: the page server and the relay are both up
        assert f"{ps['address']}:{ps['port']} " in lab.run("node-b", ["ss", "-Hltn"]).stdout
    finally:
        b.delete(f"/v1/checkpoints/{cid}")
    assert f"{ps['address']}:{ps['port']} " not in lab.run("node-b", ["ss", "-Hltn"]).stdout


def test_the_old_page_path_through_criu_tls_still_moves_the_heap(lab: Any, workload: Any) -> None:
    """What ``bench engine --old-paths criu-tls-pages`` measures against must itself be correct."""
    st = workload(node="node-a", heap_mb=16)
    plan = Plan(st["name"], "node-b", "stop-copy", "stream", old_paths=("criu-tls-pages",))
    rec = migrate(lab, plan)
    assert rec["status"] == "completed" and rec["state_after"]["sha256"] == st["sha256"]
    assert rec["security"]["pages"] == "criu tls" and (rec["page_server"] or {})["relay"] is False
    assert "page_relay" not in rec["bytes"] and rec["old_paths"] == ["criu-tls-pages"]


def test_the_old_lazy_page_path_through_criu_tls_still_moves_the_heap(lab: Any, workload: Any) -> None:
    """What ``bench engine --old-paths lazy-criu-tls`` measures against must itself be correct."""
    st = workload(node="node-a", heap_mb=16)
    rec = migrate(lab, Plan(st["name"], "node-b", "lazy", "stream", old_paths=("lazy-criu-tls",)))
    assert rec["status"] == "completed" and rec["state_after"]["sha256"] == st["sha256"]
    assert rec["security"]["pages"] == "criu tls" and "relay" not in rec["lazy"] and "relay_bytes" not in rec["lazy"]
    assert rec["old_paths"] == ["lazy-criu-tls"]


def test_the_old_eager_restore_still_moves_the_heap_and_waits_for_no_daemon(lab: Any, workload: Any) -> None:
    """``bench engine --old-paths eager-restore`` measures against the restore that reads the whole memory first."""
    st = workload(node="node-a", heap_mb=16)
    rec = migrate(lab, Plan(st["name"], "node-b", "stop-copy", "stream", old_paths=("eager-restore",)))
    assert rec["status"] == "completed" and rec["state_after"]["sha256"] == st["sha256"]
    assert rec["lazy_local"] is False and "local_pages" not in rec
    assert "target: unpacking, lazy-pages daemon start" not in rec["blackout_steps"]["steps"]


def test_names_that_a_command_line_would_read_as_options_are_refused_at_the_agent(lab: Any, workload: Any) -> None:
    st = workload(node="node-a")
    a = lab.agent("node-a")
    for method, path in (("POST", "/v1/containers/--all/stop"), ("DELETE", "/v1/containers/-a")):
        with pytest.raises(UsageError, match="not a valid name in"):
            a.call(method, path, {})
    with pytest.raises(UsageError, match="not a valid container name: '--all'"):
        a.post("/v1/containers", {"name": "--all", "image": "x"})
    assert manage.state(lab, st["name"])["node"] == "node-a", "nothing was stopped"


def test_the_lan_agent_fetches_service_urls_only(lab: Any, workload: Any) -> None:
    st = workload(node="node-a")
    lan = lab.agent("lan")
    for url in ("file:///etc/passwd", f"http://{layout.node_ip('node-a')}:{layout.AGENT_PORT}/v1/info",
                f"http://{layout.LAN_GATEWAY}:{layout.AGENT_PORT}/v1/info", f"http://{layout.REGISTRY}/debug",
                f"https://{st['ip']}:8000/"):  # fmt: skip
        with pytest.raises(UsageError, match="fetches http:// URLs of service addresses"):
            lan.post("/v1/http", {"url": url})
    assert lan.post("/v1/http", {"url": f"http://{st['ip']}:8000/state"})["ok"]


def test_a_pushed_checkpoint_rests_as_ciphertext_and_is_refused_in_another_migration(lab: Any, workload: Any) -> None:
    st = workload(node="node-a", heap_mb=32)
    a, b = lab.agent("node-a"), lab.agent("node-b")
    cid = f"sec-{uuid.uuid4().hex[:6]}"
    ref = f"{layout.REGISTRY}/podmigrate/sec:{cid}"
    key = seal.new_key()
    a.post(f"/v1/containers/{st['name']}/checkpoint", {"checkpoint_id": cid, "leave_running": True})
    try:
        pushed = a.post(
            f"/v1/checkpoints/{cid}/push",
            {"reference": ref, "annotations": checkpoint_annotations(st["name"]), "seal": key},
        )
        blob = next((lab.dir / "registry").rglob(f"{pushed['layer_digest'].split(':')[1]}/data"))
        head = blob.read_bytes()[:65536]
        assert head.startswith(seal.MAGIC) and b"checkpoint/" not in head  # a tar would name its members
        for body, why in (({"seal": seal.new_key()}, "not sealed for this migration"), ({}, "has no key")):
            with pytest.raises(TransportError, match=why):
                b.post(f"/v1/checkpoints/{cid}/pull", {"reference": ref, **body})
            assert not [f for f in lab.run("node-b", ["ls", layout.NODE_CHECKPOINTS]).stdout.split() if cid in f]
        got = b.post(f"/v1/checkpoints/{cid}/pull", {"reference": ref, "seal": key})
        assert got["layer_digest"] == pushed["layer_digest"]
    finally:
        a.post("/v1/registry/delete", {"reference": ref})
        a.delete(f"/v1/checkpoints/{cid}")
        b.delete(f"/v1/checkpoints/{cid}")
    assert manage.state(lab, st["name"])["sha256"] == st["sha256"]


def test_every_migration_seals_and_keeps_its_key_out_of_the_record(
    lab: Any, workload: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys: list[str] = []
    made = seal.new_key

    def recorded() -> str:
        keys.append(made())
        return keys[-1]

    monkeypatch.setattr(seal, "new_key", recorded)
    st = workload(node="node-a", heap_mb=32)
    rec = migrate(lab, Plan(workload=st["name"], target="node-b", transport="registry"))
    assert rec["status"] == "completed"
    # what crossed, as it crossed: the image sealed, no pages beside it, no agent-to-agent upload
    assert rec["security"] == {"sealed": True, "controller": "unix socket + token"}
    (key,) = keys  # the migration's key: nowhere in its record, the database or the agents' logs
    assert key not in json.dumps(rec)
    for where in [lab.dir / "state.db", *(lab.dir / "logs").glob("*.log")]:
        assert key.encode() not in where.read_bytes(), where
    assert rec["bytes"]["pushed"] == rec["bytes"]["pulled"] == seal.sealed_size(rec["bytes"]["archive"])
