"""Attacks on the agents and on checkpoints in transit, tried for real on loopback (no lab, no root).

The agents' TCP listener with mutual TLS (``agent.tls``) and the lab's CA (``pki``); the seal on
checkpoints (``transport.seal``) and the node agent's upload route that opens it; body limits and
error replies (``agent.http``). The same attacks inside a lab are in ``tests/test_lab_security.py``.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import io
import json
import os
import socket
import ssl
import struct
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from podmigrate.agent import tls
from podmigrate.agent.http import MAX_JSON, App, make_handler
from podmigrate.agent.node import NodeAgent
from podmigrate.errors import TransportError, UsageError
from podmigrate.pki import CA
from podmigrate.transport import seal, stream
from tests.tls_helpers import serving

TOKEN = "t0ken"


@pytest.fixture
def ca(tmp_path: Path) -> CA:
    return CA(tmp_path / "pki", "test")


def _files(ca: CA, name: str) -> tls.Files:
    ident = ca.issue(name, ips=["127.0.0.1"])
    return tls.Files(str(ident.cert), str(ident.key), str(ident.ca))


def _app(peers: frozenset[str] | None = None) -> App:
    a = App("node-a", "node", TOKEN, peers=peers)

    @a.route("GET", "/v1/whoami")
    def whoami(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"ok": True}

    @a.route("POST", "/v1/echo")
    def echo(p: dict[str, str], b: dict[str, Any]) -> Any:
        return b

    @a.route("GET", "/v1/handover", peer=True)
    def handover(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"handed": True}

    return a


@pytest.fixture
def served(ca: CA) -> Iterator[int]:
    handler = make_handler(_app(frozenset({"node-b"})))
    with serving(tls.TLSHTTPServer(("127.0.0.1", 0), handler, _files(ca, "node-a").server())) as port:
        yield port


def _get(
    port: int, ctx: ssl.SSLContext, headers: dict[str, str] | None = None, path: str = "/v1/handover"
) -> tuple[int, Any]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_peer_with_a_certificate_of_the_labs_ca_is_served_without_any_token(ca: CA, served: int) -> None:
    assert _get(served, _files(ca, "node-b").client()) == (200, {"handed": True})


def test_a_peer_may_call_only_the_routes_open_to_peers_even_with_the_token(ca: CA, served: int) -> None:
    status, data = _get(served, _files(ca, "node-b").client(), {"Authorization": f"Bearer {TOKEN}"}, "/v1/whoami")
    assert status == 403
    assert data["error"]["message"] == "agent node-a: GET /v1/whoami is not open to peers ('node-b')"


def test_a_certificate_without_a_name_is_refused_and_its_token_is_not_consulted(ca: CA, served: int) -> None:
    # a leaf of the lab's CA with no common name: verified, but names nobody
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    ca_key = serialization.load_pem_private_key(ca.key_path.read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_path.read_bytes())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("nobody")]), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)  # type: ignore[arg-type]
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    dest = ca.cert_path.parent
    (dest / "nobody.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (dest / "nobody.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    files = tls.Files(str(dest / "nobody.crt"), str(dest / "nobody.key"), str(ca.cert_path))
    handler = make_handler(_app())  # any certificate of the CA would do, had it a name
    with serving(tls.TLSHTTPServer(("127.0.0.1", 0), handler, _files(ca, "node-a").server())) as port:
        status, data = _get(port, files.client(), {"Authorization": f"Bearer {TOKEN}"})
    assert status == 401
    assert data["error"]["message"] == "agent node-a: certificate '' is not one of its peers"


def test_a_peer_without_a_certificate_gets_no_connection_even_with_the_token(ca: CA, served: int) -> None:
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))  # trusts the agent, shows nothing
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _get(served, ctx, {"Authorization": f"Bearer {TOKEN}"})


def test_a_certificate_of_another_ca_gets_no_connection(ca: CA, served: int, tmp_path: Path) -> None:
    other = CA(tmp_path / "other", "stranger")
    ident = other.issue("node-b", ips=["127.0.0.1"])
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))
    ctx.load_cert_chain(str(ident.cert), str(ident.key))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _get(served, ctx)


def test_a_lab_certificate_that_is_not_one_of_the_agents_peers_is_refused_by_name(ca: CA, served: int) -> None:
    status, data = _get(served, _files(ca, "controller").client())
    assert status == 401
    assert data["error"]["message"] == "agent node-a: certificate 'controller' is not one of its peers"


def test_a_silent_client_does_not_stall_the_listener(ca: CA, served: int) -> None:
    with socket.create_connection(("127.0.0.1", served)):  # connects, never says hello
        assert _get(served, _files(ca, "node-b").client())[0] == 200


def _raw(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    """One request over plain HTTP to a handler without TLS (the Unix socket's handler is the same)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sk:
        sk.sendall(request)
        f = sk.makefile("rb")
        status = int(f.readline().split()[1])
        length = 0
        while (line := f.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, json.loads(f.read(length))


@pytest.fixture
def plain() -> Iterator[int]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), make_handler(_app()))) as port:
        yield port


def test_an_oversized_body_is_refused_with_413_before_it_is_read(plain: int) -> None:
    n = MAX_JSON + 1
    head = f"POST /v1/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {n}\r\n\r\n"
    status, data = _raw(plain, head.encode())  # the body is never sent: the agent must not wait for it
    assert status == 413
    assert data["error"]["message"] == f"a request body of {n} bytes is over this agent's limit of {MAX_JSON} bytes"


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"[1, 2]", "the request body must be a JSON object"), (b"{nope", "the request body is not JSON")],
)
def test_a_body_that_is_not_a_json_object_is_a_400_not_a_crash(plain: int, body: bytes, message: str) -> None:
    head = f"POST /v1/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
    status, data = _raw(plain, head.encode() + body)
    assert (status, data["error"]["message"]) == (400, message)


# ------------------------------------------------------------------------------ the seal


def _sealed(data: bytes, key: str, context: str) -> bytes:
    return b"".join(seal.seal(iter([data[i : i + 300_000] for i in range(0, len(data), 300_000)]), key, context))


def _open(blob: bytes, key: str, context: str) -> bytes:
    return b"".join(seal.open_all(iter([blob[i : i + 65536] for i in range(0, len(blob), 65536)]), key, context, "x"))


def _frames(blob: bytes) -> list[bytes]:
    out, at = [], seal.HEADER
    while at < len(blob):
        n = struct.unpack(">I", blob[at : at + 4])[0] & 0x7FFFFFFF
        out.append(blob[at : at + 4 + n])
        at += 4 + n
    return out


DATA = os.urandom(3 * seal.FRAME + 12345)


def test_a_sealed_checkpoint_opens_with_its_key_and_is_ciphertext_meanwhile() -> None:
    key = seal.new_key()
    blob = _sealed(DATA, key, "m1/m1")
    assert len(blob) == seal.sealed_size(len(DATA))
    assert DATA[:4096] not in blob and DATA[-4096:] not in blob
    assert _open(blob, key, "m1/m1") == DATA


def _tampered(blob: bytes) -> bytes:
    b = bytearray(blob)
    b[seal.HEADER + 4 + 1000] ^= 1
    return bytes(b)


def _reordered(blob: bytes) -> bytes:
    f = _frames(blob)
    return blob[: seal.HEADER] + f[1] + f[0] + b"".join(f[2:])


def _truncated(blob: bytes) -> bytes:
    return blob[: seal.HEADER] + b"".join(_frames(blob)[:-1])


def _duplicated(blob: bytes) -> bytes:
    f = _frames(blob)
    return blob[: seal.HEADER] + f[0] + b"".join(f)


@pytest.mark.parametrize(
    ("attack", "why"),
    [
        (_tampered, "frame 0 does not authenticate"),
        (_reordered, "frame 0 does not authenticate"),
        (_truncated, "cut off before its final frame"),
        (_duplicated, "frame 1 does not authenticate"),
    ],
)
def test_a_tampered_reordered_duplicated_or_truncated_stream_is_refused(attack: Any, why: str) -> None:
    key = seal.new_key()
    with pytest.raises(TransportError, match=why):
        _open(attack(_sealed(DATA, key, "m1/m1")), key, "m1/m1")


def test_a_stream_replayed_from_another_migration_or_for_another_checkpoint_is_refused() -> None:
    key = seal.new_key()
    blob = _sealed(DATA, key, "m1/m1")
    with pytest.raises(TransportError, match="frame 0 does not authenticate"):
        _open(blob, seal.new_key(), "m1/m1")  # another migration: another key
    with pytest.raises(TransportError, match="frame 0 does not authenticate"):
        _open(blob, key, "m1/m1.sidecar")  # the same migration's other member


# ------------------------------------------------------------------------------ the upload route


@pytest.fixture
def agent(ca: CA, tmp_path: Path) -> NodeAgent:
    root = tmp_path / "checkpoints"
    root.mkdir(mode=0o700)
    a = NodeAgent(App("node-b", "node", TOKEN), object(), _files(ca, "node-b"), root, tmp_path / "notice")  # type: ignore[arg-type]
    a.register()
    return a


def _upload(a: NodeAgent, cid: str, body: bytes, sealed_for: str | None) -> Any:
    headers = {stream.SEALED_HEADER: sealed_for} if sealed_for else {}
    return a.upload({"cid": cid}, {"stream": io.BytesIO(body), "length": len(body), "headers": headers})


def test_the_target_opens_a_sealed_upload_only_with_the_key_its_controller_gave_it(agent: NodeAgent) -> None:
    key = seal.new_key()
    blob = _sealed(DATA, key, "m1/m1")
    with pytest.raises(TransportError, match="which this agent has no key for"):
        _upload(agent, "m1", blob, "m1")
    agent.expect_seal({"cid": "m1"}, {"seal": key})
    with pytest.raises(TransportError, match="arrived unsealed, but its migration seals"):
        _upload(agent, "m1", DATA, None)
    with pytest.raises(TransportError, match="not sealed for this migration"):
        _upload(agent, "m1", _sealed(DATA, seal.new_key(), "m1/m1"), "m1")  # replayed from elsewhere
    assert not list(agent.files.root.iterdir()), "a refused upload leaves nothing behind"
    got = _upload(agent, "m1", blob, "m1")
    assert got == {"bytes": len(blob), "sha256": None}  # the seal proved every byte: nothing hashed
    assert agent.commit({"cid": "m1"}, {"sealed": True}) == {"sha256": None, "sealed": True}
    assert agent.files.archive("m1").read_bytes() == DATA
    assert oct(agent.files.archive("m1").stat().st_mode & 0o777) == "0o600"


def test_a_sealed_upload_is_committed_by_its_seal_or_by_both_ends_sha256_but_never_unproven(agent: NodeAgent) -> None:
    key = seal.new_key()
    agent.expect_seal({"cid": "m1"}, {"seal": key})
    blob = _sealed(DATA, key, "m1/m1")
    # the old path (engine.paths "sha256-of-sealed-streams"): hashed on both ends, committed by digest
    hashed = {stream.SEALED_HEADER: "m1", stream.DIGEST_HEADER: "sha256"}
    got = agent.upload({"cid": "m1"}, {"stream": io.BytesIO(blob), "length": len(blob), "headers": hashed})
    assert got["sha256"] == hashlib.sha256(DATA).hexdigest()
    with pytest.raises(TransportError, match="committed as sealed, but it arrived unsealed or hashed"):
        agent.commit({"cid": "m1"}, {"sealed": True})
    assert not list(agent.files.root.iterdir()), "a refused commit leaves nothing behind"
    # cut short: refused as it arrives, so there is nothing to commit
    with pytest.raises(TransportError, match="cut off before its final frame"):
        _upload(agent, "m1", _truncated(blob), "m1")
    with pytest.raises(TransportError, match="no received checkpoint"):
        agent.commit({"cid": "m1"}, {"sealed": True})
    # an unsealed upload (a migration without a key) needs its sender's digest
    agent.delete({"cid": "m2"}, {})
    _upload(agent, "m2", DATA, None)
    with pytest.raises(TransportError, match="committed as sealed, but it arrived unsealed"):
        agent.commit({"cid": "m2"}, {})
    _upload(agent, "m2", DATA, None)
    agent.commit({"cid": "m2"}, {"sha256": hashlib.sha256(DATA).hexdigest()})
    assert agent.files.archive("m2").read_bytes() == DATA


def test_a_sealed_stream_opens_fed_in_pieces_of_any_size() -> None:
    key = seal.new_key()
    blob = _sealed(DATA, key, "m1/m1")
    sizes = [1, 3, seal.HEADER, 4, seal.FRAME + 7, 2, seal.FRAME * 2 + 30, 65536]
    opener, out, at, i = seal.Opener(key, "m1/m1", "x"), [], 0, 0
    while at < len(blob):
        out.append(opener.feed(blob[at : at + sizes[i % len(sizes)]]))
        at += sizes[i % len(sizes)]
        i += 1
    opener.close()
    assert b"".join(out) == DATA


def test_a_seal_key_that_is_not_32_bytes_is_a_usage_error(agent: NodeAgent) -> None:
    with pytest.raises(UsageError, match="64 hex digits"):
        agent.expect_seal({"cid": "m1"}, {"seal": "abcd"})


def test_a_kubeconfigs_inline_client_key_is_written_owner_only_and_removed_at_exit(tmp_path: Path) -> None:
    import base64
    import subprocess
    import sys

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        json.dumps(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443",
                                                        "certificate-authority-data": b64("CA")}}],
                "users": [{"name": "u", "user": {"client-certificate-data": b64("CERT"),
                                                 "client-key-data": b64("SECRET KEY")}}],
            }
        )
    )  # fmt: skip
    code = (
        "import json, os, sys; from pathlib import Path; from podmigrate.k8s.api import KubeConfig\n"
        "c = KubeConfig._from_kubeconfig(Path(sys.argv[1]))\n"
        "files = [c.verify, *c.cert]\n"
        "print(json.dumps({f: [oct(os.stat(f).st_mode & 0o777), open(f).read()] for f in files}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, check=True)
    seen = json.loads(p.stdout)
    assert sorted(v[1] for v in seen.values()) == ["CA", "CERT", "SECRET KEY"]
    assert {v[0] for v in seen.values()} == {"0o600"}
    assert not [f for f in seen if os.path.exists(f)], "a client key must not outlive the process"
