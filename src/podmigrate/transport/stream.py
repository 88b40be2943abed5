"""The ``stream`` transport: the source agent sends the checkpoint straight to the target agent.

No registry and no second copy: one HTTPS PUT over the LAN (mutual TLS with the nodes' certificates,
``agent.tls``), read in 1 MiB blocks and, by default, sealed for the migration (``transport.seal``:
AES-256-GCM with a key only the two agents have), so that a peer that could read or change the
connection still could not read or change the checkpoint. The receiver opens the seal as it writes
``<id>.tar.part``; the sender then commits, and only then does the file become ``<id>.tar``, the
name restore reads. What the commit checks: for a sealed upload, that every frame authenticated and
the final one arrived (the seal already proves each byte and the end); for an unsealed one, the
SHA-256 of what was written against the one the sender computed. (Sealed uploads were hashed on
both ends too until issue 14: 2 x 9 ms per 16 MB on a lazy migration's prefetch path, proving what
the seal had proved; ``engine.paths`` "sha256-of-sealed-streams" puts it back to measure it.) In
this transport the memory pages went to the target's CRIU page server during the dump, so what is
sent is the rest of the archive; sibling ``transport.archive`` sends a whole export through the same
functions. Runs in node agents.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from podmigrate.errors import TransportError
from podmigrate.transport import seal
from podmigrate.transport.base import Sent

if TYPE_CHECKING:
    from podmigrate.transport.base import Transport

CHUNK = 1 << 20
SEALED_HEADER = "X-Podmigrate-Sealed-For"  # the checkpoint id whose key seals this upload
DIGEST_HEADER = "X-Podmigrate-Digest"  # "sha256": the sender commits a sealed upload with its SHA-256 too
SEALED_MARK = "sealed"  # a received upload whose every frame opened, through the final one


class Streamed(Sent):
    sha256: str | None  # of the bytes sent, which the target's commit matched; None: sealed, not hashed
    sealed: bool


@dataclass(frozen=True)
class Seal:
    """A migration's key and the checkpoint it belongs to (the receiver's key is found by it)."""

    key: str = field(repr=False)  # a repr ends up in logs and tracebacks
    checkpoint: str
    digest: bool = False  # hash a sealed upload on both ends as well (the old path, for measuring)

    def context(self, upload: str) -> str:
        return f"{self.checkpoint}/{upload}"


class StreamTransport:
    """Sends ``<id>.tar`` to the agent on host ``to`` (its ``port``; ``tls`` holds the CA and this
    node's certificate), sealed with ``sealed`` if given; the target's upload route receives it
    (``receive``) and its commit route checks it (``commit``)."""

    def __init__(self, tls: ssl.SSLContext, port: int, sealed: Seal | None = None):
        self.tls, self.port, self.sealed = tls, port, sealed

    def with_seal(self, sealed: Seal | None) -> StreamTransport:
        return type(self)(self.tls, self.port, sealed)

    def send(self, archive: Path, to: str) -> Streamed:
        return send(archive, to, self.port, archive.name.removesuffix(".tar"), self.tls, self.sealed)


if TYPE_CHECKING:

    def _conforms(t: StreamTransport) -> Transport:
        return t


def _blocks(archive: Path, h: Any) -> Iterator[bytes]:
    with open(archive, "rb") as f:
        while block := f.read(CHUNK):
            if h is not None:
                h.update(block)
            yield block


def send(archive: Path, host: str, port: int, cid: str, tls: ssl.SSLContext, sealed: Seal | None = None) -> Streamed:
    size = archive.stat().st_size
    h = hashlib.sha256() if sealed is None or sealed.digest else None
    t0 = time.time()
    conn = http.client.HTTPSConnection(host, port, timeout=120, context=tls)
    try:
        conn.putrequest("PUT", f"/v1/checkpoints/{cid}")
        conn.putheader("Content-Type", "application/octet-stream")
        body = _blocks(archive, h)
        if sealed is not None:
            conn.putheader(SEALED_HEADER, sealed.checkpoint)
            if h is not None:
                conn.putheader(DIGEST_HEADER, "sha256")
            conn.putheader("Content-Length", str(seal.sealed_size(size)))
            body = seal.seal(body, sealed.key, sealed.context(cid))
        else:
            conn.putheader("Content-Length", str(size))
        conn.endheaders()
        assert conn.sock is not None
        channel = _channel(conn.sock)
        try:
            for block in body:
                conn.sock.sendall(block)
        except (BrokenPipeError, ConnectionResetError) as e:
            # the receiver stopped reading: its answer (e.g. a full disk) says why
            reason = _early_answer(conn)
            raise TransportError(
                f"the target stopped receiving {archive.name}: {reason or e}",
                hint="is the target node's disk full?" if "space" in reason else None,
            ) from e
        resp = conn.getresponse()
        body = json.loads(resp.read() or b"{}")
    except OSError as e:
        conn.close()
        raise TransportError(
            f"streaming {archive.name} to {host}:{port} failed: {e}",
            hint="is the target agent up and the LAN link working?",
        ) from e
    if resp.status != 200:
        conn.close()
        raise TransportError(
            f"the target agent refused the checkpoint stream ({resp.status}): "
            f"{body.get('error', {}).get('message', body)}"
        )
    sent = h.hexdigest() if h is not None else None
    # the commit on the same connection (no second TLS handshake inside a lazy blackout);
    # http.client opens a new one if the agent closed this one
    try:
        payload = json.dumps({"sha256": sent} if sent else {"sealed": True}).encode()
        conn.request(
            "POST", f"/v1/checkpoints/{cid}/commit", body=payload, headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        body = json.loads(resp.read() or b"{}")
    except OSError as e:
        raise TransportError(f"committing {cid} on {host}:{port} failed: {e}") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise TransportError(
            f"the target did not accept checkpoint {cid}: {body.get('error', {}).get('message', body)}"
        )
    return {
        "bytes": size,
        "sha256": sent,
        "sealed": sealed is not None,
        "channel": channel,
        "started": t0,
        "ended": time.time(),
    }


def _channel(sock: object) -> str:
    """How an upload crosses, as its connection is: the agents' listener asks every client for a
    certificate of the lab's CA before any route (``agent.tls``), so an accepted TLS upload went
    over mutual TLS; the version is the one negotiated."""
    return f"mutual TLS ({sock.version()})" if isinstance(sock, ssl.SSLSocket) else "plain TCP"


def _early_answer(conn: http.client.HTTPConnection) -> str:
    try:
        resp = conn.getresponse()
        body = json.loads(resp.read() or b"{}")
        return str(body.get("error", {}).get("message", ""))
    except (OSError, ValueError, http.client.HTTPException):
        return ""


def receive(stream: IO[bytes], length: int, dest: Path, sealed: Seal | None = None) -> dict[str, Any]:
    """Write ``length`` bytes from ``stream`` to ``dest.part`` (owner-only), opening the seal first
    when ``sealed``; what is written is hashed unless sealed (``sealed.digest``: hashed all the same)."""
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256() if sealed is None or sealed.digest else None
    got = 0
    opener = seal.Opener(sealed.key, sealed.context(dest.name.removesuffix(".tar")), dest.name) if sealed else None
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            while got < length:
                block = stream.read(min(CHUNK, length - got))
                if not block:
                    break
                got += len(block)
                if opener is not None:
                    block = opener.feed(block)
                if h is not None:
                    h.update(block)
                f.write(block)
        if got == length and opener is not None:
            opener.close()
    except OSError as e:
        part.unlink(missing_ok=True)
        raise TransportError(
            f"writing {dest.name} failed after {got} bytes: {e}", hint="is the target node's disk full?"
        ) from e
    except TransportError:
        part.unlink(missing_ok=True)
        raise
    if got != length:
        part.unlink(missing_ok=True)
        raise TransportError(f"the checkpoint stream ended after {got} of {length} bytes")
    have = h.hexdigest() if h is not None else SEALED_MARK
    part.with_name(part.name + ".sha256").write_text(have)
    return {"bytes": got, "sha256": have if h is not None else None}


def commit(dest: Path, sha256: str | None) -> dict[str, Any]:
    """Accept ``dest.part`` as ``dest`` only if the sender's digest equals the one computed here, or,
    with ``sha256`` None, if it arrived sealed and every frame of it opened (``receive``)."""
    part = dest.with_name(dest.name + ".part")
    mark = part.with_name(part.name + ".sha256")
    try:
        have = mark.read_text().strip()
    except OSError as e:
        raise TransportError(f"no received checkpoint {dest.name} to commit") from e
    if sha256 is None and have != SEALED_MARK:
        why = "was committed as sealed, but it arrived unsealed or hashed"
        hint = "an unsealed upload is committed with the SHA-256 its sender computed"
    elif sha256 is not None and have != sha256:
        why = f"arrived as sha256:{have} but was sent as sha256:{sha256}"
        hint = "the stream was corrupted or tampered with"
    else:
        why = hint = ""
    if why:
        part.unlink(missing_ok=True)
        mark.unlink(missing_ok=True)
        raise TransportError(f"checkpoint {dest.name} {why}; refusing to restore from it", hint=hint)
    part.rename(dest)
    mark.unlink()
    return {"sha256": sha256, "sealed": sha256 is None}
