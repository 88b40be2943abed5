"""A minimal, streaming OCI distribution client (runs in node agents; standard library only).

Generic registry plumbing: TLS choice, credentials from ``REGISTRY_AUTH_FILE``, Basic and Bearer
challenges, blob and manifest calls, compression on the way up and down. What a checkpoint image
holds is ``transport.registry``'s business; the Kubernetes agent and its tests use ``Registry`` too.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import ssl
import subprocess
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import SplitResult, urlsplit

from podmigrate.errors import TransportError
from podmigrate.transport import seal

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
CHUNK = 1 << 20

COMPRESSIONS = ("none", "gzip", "zstd")
MEDIA_SUFFIX = {"none": "", "gzip": "+gzip", "zstd": "+zstd"}  # of a layer's media type, by compression
# after the compression suffix: the layer is sealed for one migration (``transport.seal``; our own
# format, not ocicrypt's JWE: only the two agents of that migration hold the key)
SEALED_SUFFIX = "+podmigrate-sealed"


def split_reference(ref: str) -> tuple[str, str, str]:
    """'10.77.0.1:5000/podmigrate/ckpt-web:abc' -> (host, repository, tag)."""
    host, _, rest = ref.partition("/")
    repo, _, tag = rest.rpartition(":")
    if not host or not repo or not tag or "/" in tag:
        raise TransportError(f"not an image reference with a tag: {ref!r}")
    return host, repo, tag


def _compress(chunks: Iterator[bytes], compression: str) -> Iterator[bytes]:
    """Compress a stream of blocks: gzip in-process (single-threaded, like the study's buildah), zstd
    with the multi-threaded ``zstd -T0``."""
    if compression == "none":
        yield from chunks
    elif compression == "gzip":
        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        for block in chunks:
            if out := z.compress(block):
                yield out
        yield z.flush()
    elif compression == "zstd":
        proc = subprocess.Popen(["zstd", "-q", "-T0", "-3", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        stdin = proc.stdin

        def feed() -> None:
            try:
                for block in chunks:
                    stdin.write(block)
            finally:
                stdin.close()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        while out := proc.stdout.read(CHUNK):
            yield out
        feeder.join()
        if proc.wait():
            raise TransportError(f"zstd failed with exit code {proc.returncode}")
    else:
        raise TransportError(f"unknown compression {compression!r}; use one of {', '.join(COMPRESSIONS)}")


class _Sink:
    """Writes a (possibly compressed) blob to a file, decompressing on the way."""

    def __init__(self, f: IO[bytes], compression: str):
        self.f, self.compression = f, compression
        self.z = zlib.decompressobj(31) if compression == "gzip" else None
        self.proc = (
            subprocess.Popen(["zstd", "-d", "-q", "-c"], stdin=subprocess.PIPE, stdout=f)
            if compression == "zstd"
            else None
        )

    def write(self, block: bytes) -> None:
        if self.z is not None:
            self.f.write(self.z.decompress(block))
        elif self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(block)
        else:
            self.f.write(block)

    def close(self) -> None:
        if self.z is not None:
            self.f.write(self.z.flush())
        elif self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            if self.proc.wait():
                raise TransportError(f"zstd -d failed with exit code {self.proc.returncode}")


def _tls_for(host: str) -> bool:
    """``PODMIGRATE_REGISTRY_TLS``: ``1`` for every registry, or a comma-separated list of hosts.
    Plain HTTP otherwise, as the lab's registry and the study's testbed use."""
    value = os.environ.get("PODMIGRATE_REGISTRY_TLS", "")
    return value == "1" or host in {h.strip() for h in value.split(",") if h.strip()}


def _credentials(host: str) -> str | None:
    """``user:password`` base64 for ``host`` from a containers-auth.json (``REGISTRY_AUTH_FILE``, the
    file podman, buildah and skopeo read; a Kubernetes dockerconfigjson Secret has the same shape)."""
    path = os.environ.get("REGISTRY_AUTH_FILE")
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        auths = (json.load(f) or {}).get("auths") or {}
    entry = auths.get(host) or auths.get(f"https://{host}") or {}
    auth = entry.get("auth")
    return str(auth) if auth else None


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="https://auth",service="reg",scope="..."`` -> ("bearer", {realm, service, scope})."""
    scheme, _, rest = header.partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class Registry:
    """A minimal OCI distribution client: only what checkpoint images need, streaming both ways.

    Plain HTTP or TLS (``PODMIGRATE_REGISTRY_TLS``, CA bundle in ``PODMIGRATE_REGISTRY_CA``); anonymous,
    Basic or token (Bearer) authentication with credentials from ``REGISTRY_AUTH_FILE``. The
    challenge is taken once, up front, from ``GET /v2/``: a streamed upload cannot be replayed after a
    401."""

    def __init__(self, host: str, timeout: float = 60.0, repo: str | None = None):
        self.host, self.timeout, self.repo = host, timeout, repo
        self.tls = _tls_for(host)
        self._auth: dict[str, str] | None = None

    def _conn(self) -> http.client.HTTPConnection:
        if self.tls:
            ctx = ssl.create_default_context(cafile=os.environ.get("PODMIGRATE_REGISTRY_CA") or None)
            return http.client.HTTPSConnection(self.host, timeout=self.timeout, context=ctx)
        return http.client.HTTPConnection(self.host, timeout=self.timeout)

    def _authorization(self) -> dict[str, str]:
        if self._auth is not None:
            return self._auth
        self._auth = {}
        resp, conn = self._send("GET", "/v2/", None, {}, False)
        resp.read()
        conn.close()
        if resp.status != 401:
            return self._auth
        scheme, params = _challenge(resp.headers.get("WWW-Authenticate", ""))
        creds = _credentials(self.host)
        if scheme == "basic":
            if not creds:
                raise TransportError(
                    f"registry {self.host} wants credentials",
                    hint="put them in a containers-auth.json and point REGISTRY_AUTH_FILE at it",
                )
            if not self.tls:
                raise TransportError(
                    f"registry {self.host} asks for Basic credentials over plain HTTP, where anyone on the "
                    "path could read them; refused",
                    hint=f"serve it over TLS and set PODMIGRATE_REGISTRY_TLS={self.host} (and PODMIGRATE_REGISTRY_CA)",
                )
            self._auth = {"Authorization": f"Basic {creds}"}
        elif scheme == "bearer" and params.get("realm"):
            realm = urlsplit(params["realm"])
            if realm.scheme != "https" or realm.hostname != urlsplit(f"//{self.host}").hostname:
                raise TransportError(
                    f"registry {self.host} sends for its token to {params['realm']!r}; only an https:// realm "
                    "on the registry's own host is followed, so that no credentials go elsewhere",
                    hint="configure the registry's token realm as https://<registry host>/...",
                )
            if not self.tls:  # the token would then travel to the registry in clear, as good as a password
                raise TransportError(
                    f"registry {self.host} asks for a Bearer token over plain HTTP; refused",
                    hint=f"serve it over TLS and set PODMIGRATE_REGISTRY_TLS={self.host} (and PODMIGRATE_REGISTRY_CA)",
                )
            query = {"service": params.get("service", "")}
            if self.repo:
                query["scope"] = f"repository:{self.repo}:pull,push,delete"
            self._auth = {"Authorization": f"Bearer {self._token(realm, query, creds)}"}
        return self._auth

    def _token(self, realm: SplitResult, query: dict[str, str], creds: str | None) -> str:
        """A token from ``realm`` (checked https:// on the registry's host). One request and no
        redirects: a redirect would carry the Basic credentials to wherever it points."""
        ctx = ssl.create_default_context(cafile=os.environ.get("PODMIGRATE_REGISTRY_CA") or None)
        conn = http.client.HTTPSConnection(realm.netloc, timeout=self.timeout, context=ctx)
        headers = {"Authorization": f"Basic {creds}"} if creds else {}
        where = f"https://{realm.netloc}{realm.path}"
        try:
            conn.request("GET", f"{realm.path or '/'}?{urllib.parse.urlencode(query)}", headers=headers)
            resp = conn.getresponse()
            body = resp.read(1 << 20)
            if resp.status != 200:
                raise TransportError(f"registry {self.host}: its token service {where} answered {resp.status}")
            tok = json.loads(body)
        except (OSError, ValueError) as e:
            raise TransportError(f"registry {self.host}: getting a token from {where} failed: {e}") from e
        finally:
            conn.close()
        token = tok.get("token") or tok.get("access_token") if isinstance(tok, dict) else None
        if not isinstance(token, str) or not token:
            raise TransportError(f"registry {self.host}: its token service {where} gave no token")
        return token

    def _send(
        self, method: str, path: str, body: Any, headers: dict[str, str], chunked: bool
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        conn = self._conn()
        try:
            conn.request(method, path, body=body, headers=headers, encode_chunked=chunked)
            return conn.getresponse(), conn
        except OSError as e:
            conn.close()
            raise TransportError(
                f"registry {self.host} unreachable during {method} {path}: {e}",
                hint="is the registry running and reachable from this node? (lab: `podmigrate lab status`)",
            ) from e

    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200, 201, 202),
        chunked: bool = False,
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        resp, conn = self._send(method, path, body, {**(headers or {}), **self._authorization()}, chunked)
        if resp.status not in ok:
            text = resp.read(2000).decode(errors="replace")
            conn.close()
            raise TransportError(
                f"registry {self.host} answered {resp.status} to {method} {path}: {text}",
                hint="check the credentials in REGISTRY_AUTH_FILE" if resp.status in (401, 403) else None,
            )
        return resp, conn

    def _upload(self, repo: str, body: Any, digest_fn: Callable[[], str], chunked: bool) -> None:
        resp, conn = self._request("POST", f"/v2/{repo}/blobs/uploads/")
        resp.read()
        conn.close()
        loc = resp.headers["Location"]
        u = urlsplit(loc)
        path = u.path + (f"?{u.query}" if u.query else "")
        resp, conn = self._request(
            "PATCH", path, body=body, chunked=chunked, headers={"Content-Type": "application/octet-stream"}
        )
        resp.read()
        conn.close()
        u = urlsplit(resp.headers["Location"])
        sep = "&" if u.query else "?"
        resp, conn = self._request(
            "PUT", f"{u.path}?{u.query}{sep}digest={digest_fn()}", headers={"Content-Length": "0"}
        )
        resp.read()
        conn.close()

    def push_blob_file(
        self, repo: str, path: Path, compression: str = "none", sealed: tuple[str, str] | None = None
    ) -> tuple[str, int, str]:
        """Upload ``path`` (compressed, then sealed with ``sealed`` = (key, context), on the way);
        returns the blob's digest and size, and the digest of the uncompressed content (diff_id)."""
        raw, h = hashlib.sha256(), hashlib.sha256()
        size = 0

        def read() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while block := f.read(CHUNK):
                    raw.update(block)
                    yield block

        def counted() -> Iterator[bytes]:
            nonlocal size
            blocks = _compress(read(), compression)
            for block in seal.seal(blocks, *sealed) if sealed else blocks:
                h.update(block)
                size += len(block)
                yield block

        self._upload(repo, counted(), lambda: f"sha256:{h.hexdigest()}", chunked=True)
        return f"sha256:{h.hexdigest()}", size, f"sha256:{raw.hexdigest()}"

    def push_blob_bytes(self, repo: str, data: bytes) -> tuple[str, int]:
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        self._upload(repo, data, lambda: digest, chunked=False)
        return digest, len(data)

    def put_manifest(self, repo: str, tag: str, manifest: dict[str, Any]) -> str:
        body = json.dumps(manifest).encode()
        resp, conn = self._request(
            "PUT", f"/v2/{repo}/manifests/{tag}", body=body, headers={"Content-Type": MANIFEST_TYPE}
        )
        resp.read()
        conn.close()
        return resp.headers.get("Docker-Content-Digest") or f"sha256:{hashlib.sha256(body).hexdigest()}"

    def get_manifest(self, repo: str, ref: str) -> tuple[dict[str, Any], str]:
        accept = f"{MANIFEST_TYPE}, application/vnd.docker.distribution.manifest.v2+json"
        resp, conn = self._request("GET", f"/v2/{repo}/manifests/{ref}", headers={"Accept": accept}, ok=(200,))
        body = resp.read()
        conn.close()
        return json.loads(body), resp.headers.get("Docker-Content-Digest", "")

    def fetch_blob(
        self,
        repo: str,
        digest: str,
        dest: Path,
        expect_size: int | None = None,
        compression: str = "none",
        sealed: tuple[str, str] | None = None,
    ) -> int:
        """Stream a blob into ``dest`` (owner-only), failing if its digest or size differ, or if
        it does not open with ``sealed`` = (key, context)."""
        resp, conn = self._request("GET", f"/v2/{repo}/blobs/{digest}", ok=(200,))
        h = hashlib.sha256()
        size = 0
        tmp = dest.with_name(dest.name + ".part")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                sink = _Sink(f, compression)
                opener = seal.Opener(*sealed, f"the layer {digest}") if sealed else None
                while block := resp.read(CHUNK):
                    h.update(block)
                    size += len(block)
                    sink.write(opener.feed(block) if opener else block)
                if opener:
                    opener.close()
                sink.close()
        except TransportError:
            tmp.unlink(missing_ok=True)
            raise
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise TransportError(
                f"writing {dest} failed after {size} bytes: {e}", hint="is the target node's disk full?"
            ) from e
        finally:
            conn.close()
        got = f"sha256:{h.hexdigest()}"
        if got != digest or (expect_size is not None and size != expect_size):
            tmp.unlink(missing_ok=True)
            raise TransportError(
                f"checkpoint blob {digest} arrived as {got} ({size} bytes); refusing to restore from it",
                hint="the image was corrupted or tampered with",
            )
        tmp.rename(dest)
        return size

    def delete(self, repo: str, digest: str, kind: str = "manifests") -> None:
        resp, conn = self._request("DELETE", f"/v2/{repo}/{kind}/{digest}", ok=(202, 404))
        resp.read()
        conn.close()
