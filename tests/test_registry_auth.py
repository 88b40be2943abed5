"""Checkpoint images through a registry that wants TLS and credentials (Debian's docker-registry with
htpasswd auth and a self-signed certificate, on loopback): what a cluster's registry looks like."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import tarfile
import threading
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from podmigrate.errors import TransportError
from podmigrate.transport import registry, seal, stream
from tests.conftest import wait_for
from tests.tls_helpers import free_port, self_signed_cert

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt  # bcrypt through Debian's libxcrypt: what htpasswd files hold


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("reg-auth")
    cert, key = self_signed_cert(tmp)
    (tmp / "htpasswd").write_text(f"mig:{crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
    port = free_port()
    (tmp / "config.yml").write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {tmp / 'data'}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}', tls: {{certificate: {cert}, key: {key}}}}}\n"
        f"auth: {{htpasswd: {{realm: podmigrate, path: {tmp / 'htpasswd'}}}}}\n"
    )
    proc = subprocess.Popen(["docker-registry", "serve", str(tmp / "config.yml")], stderr=subprocess.DEVNULL)
    host = f"127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in ("PODMIGRATE_REGISTRY_TLS", "PODMIGRATE_REGISTRY_CA", "REGISTRY_AUTH_FILE")}
    os.environ.update(PODMIGRATE_REGISTRY_TLS=host, PODMIGRATE_REGISTRY_CA=str(cert))
    try:
        wait_for(
            lambda: subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]).returncode == 0, 30, "registry"
        )
        yield host, tmp
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def auth_file(tmp: Path, host: str, password: str) -> Path:
    f = tmp / f"auth-{password}.json"
    f.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(f"mig:{password}".encode()).decode()}}}))
    f.chmod(0o600)
    return f


def archive(tmp: Path) -> Path:
    a = tmp / "ck.tar"
    (tmp / "pages-1.img").write_bytes(os.urandom(1 << 20))
    with tarfile.open(a, "w") as tar:
        tar.add(tmp / "pages-1.img", "checkpoint/pages-1.img")
    return a


def test_push_and_pull_with_credentials_over_tls(secured: tuple[str, Path], tmp_path: Path) -> None:
    host, tmp = secured
    os.environ["REGISTRY_AUTH_FILE"] = str(auth_file(tmp, host, "s3cret"))
    a = archive(tmp_path)
    ref = f"{host}/checkpoints/web:1"
    pushed = registry.push_checkpoint(a, ref, registry.checkpoint_annotations("web"))
    got = registry.pull_checkpoint(ref, tmp_path / "back.tar")
    assert got["layer_digest"] == pushed["layer_digest"]
    assert (
        hashlib.sha256((tmp_path / "back.tar").read_bytes()).hexdigest() == hashlib.sha256(a.read_bytes()).hexdigest()
    )
    assert registry.delete_checkpoint(ref) and not registry.delete_checkpoint(ref)


@pytest.mark.parametrize("password", [None, "wrong"])
def test_missing_or_wrong_credentials_are_said_so(
    secured: tuple[str, Path], tmp_path: Path, password: str | None
) -> None:
    host, tmp = secured
    if password is None:
        os.environ.pop("REGISTRY_AUTH_FILE", None)
        match, hint = "wants credentials", "REGISTRY_AUTH_FILE"
    else:
        os.environ["REGISTRY_AUTH_FILE"] = str(auth_file(tmp, host, password))
        match, hint = "answered 401", "credentials"
    with pytest.raises(TransportError, match=match) as e:
        registry.push_checkpoint(archive(tmp_path), f"{host}/checkpoints/web:2", {})
    assert e.value.hint and hint in e.value.hint


class _Challenger(BaseHTTPRequestHandler):
    """A registry that only ever challenges, recording every Authorization header it was sent."""

    challenge = ""
    seen: list[str] = []

    def _challenge(self) -> None:
        if self.headers.get("Authorization"):
            type(self).seen.append(self.headers["Authorization"])
        self.send_response(401)
        self.send_header("WWW-Authenticate", type(self).challenge)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _challenge

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def challenger() -> Iterator[tuple[str, type[_Challenger]]]:
    handler = type("H", (_Challenger,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    old = os.environ.get("REGISTRY_AUTH_FILE")
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        os.environ.pop("REGISTRY_AUTH_FILE", None) if old is None else os.environ.update(REGISTRY_AUTH_FILE=old)


@pytest.mark.parametrize(
    ("challenge", "match"),
    [
        ('Basic realm="registry"', "asks for Basic credentials over plain HTTP"),
        ('Bearer realm="http://{host}/token",service="r"', "only an https:// realm on the registry's own host"),
        (
            'Bearer realm="https://auth.example.net/token",service="r"',
            "only an https:// realm on the registry's own host",
        ),
        # the realm is fine, but the token would go back to the registry in clear
        ('Bearer realm="https://{host}/token",service="r"', "asks for a Bearer token over plain HTTP"),
    ],
)
def test_credentials_never_go_in_clear_nor_to_a_realm_elsewhere(
    challenger: tuple[str, type[_Challenger]], tmp_path: Path, challenge: str, match: str
) -> None:
    host, handler = challenger
    handler.challenge = challenge.format(host=host)
    os.environ["REGISTRY_AUTH_FILE"] = str(auth_file(tmp_path, host, "s3cret"))
    with pytest.raises(TransportError, match=match):
        registry.push_checkpoint(archive(tmp_path), f"{host}/checkpoints/web:3", {})
    assert handler.seen == [], "no credentials may have been sent"


def test_a_sealed_image_rests_as_ciphertext_and_opens_only_for_its_own_migration(
    secured: tuple[str, Path], tmp_path: Path
) -> None:
    host, tmp = secured
    os.environ["REGISTRY_AUTH_FILE"] = str(auth_file(tmp, host, "s3cret"))
    a = archive(tmp_path)
    plain = (tmp_path / "pages-1.img").read_bytes()
    key = seal.new_key()
    ref = f"{host}/checkpoints/sealed:1"
    pushed = registry.push_checkpoint(a, ref, registry.checkpoint_annotations("web"), "zstd", stream.Seal(key, "m1"))
    blobs = list((tmp / "data").rglob("data"))
    layer = next(b for b in blobs if pushed["layer_digest"].split(":")[1] in str(b.parent))
    assert plain[:4096] not in layer.read_bytes() and layer.read_bytes().count(b"checkpoint/pages-1.img") == 0
    # nothing at rest names the plaintext's digest (it would confirm a guess of the memory)
    plain_digest = hashlib.sha256(a.read_bytes()).hexdigest().encode()
    assert not [b for b in blobs if plain_digest in b.read_bytes()]
    for sealed, why in (
        (None, "sealed for a migration, and this pull has no key"),
        (stream.Seal(seal.new_key(), "m1"), "not sealed for this migration"),  # replayed into another migration
        (stream.Seal(key, "m2"), "not sealed for this migration"),  # the same key, another checkpoint
    ):
        with pytest.raises(TransportError, match=why):
            registry.pull_checkpoint(ref, tmp_path / "bad.tar", sealed)
        assert not (tmp_path / "bad.tar").exists() and not list(tmp_path.glob("bad.tar*"))
    registry.pull_checkpoint(ref, tmp_path / "back.tar", stream.Seal(key, "m1"))
    assert (tmp_path / "back.tar").read_bytes() == a.read_bytes()
    unsealed = f"{host}/checkpoints/plain:1"
    registry.push_checkpoint(a, unsealed, registry.checkpoint_annotations("web"))
    with pytest.raises(TransportError, match="is not sealed, but its migration seals checkpoints"):
        registry.pull_checkpoint(unsealed, tmp_path / "swap.tar", stream.Seal(key, "m1"))


class _TokenRedirect(BaseHTTPRequestHandler):
    """A TLS registry whose token service answers with a redirect to another server."""

    elsewhere = ""
    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:
        type(self).seen.append((self.path.split("?")[0], self.headers.get("Authorization") or ""))
        if self.path.startswith("/v2/"):
            host = self.headers["Host"]
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="https://{host}/token",service="r"')
        else:
            self.send_response(302)
            self.send_header("Location", f"http://{type(self).elsewhere}/steal")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_token_service_that_redirects_gets_no_credentials_beyond_its_own_host(
    challenger: tuple[str, type[_Challenger]], tmp_path: Path
) -> None:
    import ssl

    elsewhere, thief = challenger  # a plain server that records whatever reaches it
    cert, key = self_signed_cert(tmp_path)
    handler: type[_TokenRedirect] = type("T", (_TokenRedirect,), {"seen": [], "elsewhere": elsewhere})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{server.server_address[1]}"
    names = ("PODMIGRATE_REGISTRY_TLS", "PODMIGRATE_REGISTRY_CA")
    old = {k: os.environ.get(k) for k in names}
    os.environ.update(
        PODMIGRATE_REGISTRY_TLS=host,
        PODMIGRATE_REGISTRY_CA=str(cert),
        REGISTRY_AUTH_FILE=str(auth_file(tmp_path, host, "s3cret")),
    )
    try:
        with pytest.raises(TransportError, match=r"its token service https://127\.0\.0\.1:\d+/token answered 302"):
            registry.push_checkpoint(archive(tmp_path), f"{host}/checkpoints/web:4", {})
    finally:
        server.shutdown()
        server.server_close()
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.update({k: v})
    assert [p for p, _ in handler.seen] == ["/v2/", "/token"]  # the realm asked once, on its own host
    assert thief.seen == [], "the redirect was not followed"
