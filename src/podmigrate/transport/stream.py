"""The ``stream`` transport: the source agent sends the checkpoint straight to the target agent.

No registry and no second copy: one HTTP PUT over the LAN, read and hashed in 1 MiB blocks on both
ends. The receiver writes ``<id>.tar.part`` and remembers the SHA-256 it computed; the sender then
commits with the SHA-256 *it* computed, and only if they match does the file become ``<id>.tar``,
the name restore reads. In this transport the memory pages went to the target's CRIU page server
during the dump, so what is sent is the rest of the archive; sibling ``transport.archive`` sends a
whole export through the same functions. Standard library only (runs in node agents).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from podmigrate.errors import TransportError
from podmigrate.transport.base import Sent

if TYPE_CHECKING:
    from podmigrate.transport.base import Transport

CHUNK = 1 << 20


class Streamed(Sent):
    sha256: str  # of the bytes sent, which the target's commit matched


class StreamTransport:
    """Sends ``<id>.tar`` to the agent on host ``to`` (its ``port``, with this lab's ``token``); the
    target's upload route receives it (``receive``) and its commit route checks it (``commit``)."""

    def __init__(self, token: str, port: int):
        self.token, self.port = token, port

    def send(self, archive: Path, to: str) -> Streamed:
        return send(archive, to, self.port, archive.name.removesuffix(".tar"), self.token)


if TYPE_CHECKING:

    def _conforms(t: StreamTransport) -> Transport:
        return t


def send(archive: Path, host: str, port: int, cid: str, token: str) -> Streamed:
    size = archive.stat().st_size
    h = hashlib.sha256()
    t0 = time.time()
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.putrequest("PUT", f"/v1/checkpoints/{cid}")
        conn.putheader("Authorization", f"Bearer {token}")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        assert conn.sock is not None
        try:
            with open(archive, "rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
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
        raise TransportError(
            f"streaming {archive.name} to {host}:{port} failed: {e}",
            hint="is the target agent up and the LAN link working?",
        ) from e
    finally:
        conn.close()
    if resp.status != 200:
        raise TransportError(
            f"the target agent refused the checkpoint stream ({resp.status}): "
            f"{body.get('error', {}).get('message', body)}"
        )
    sent = h.hexdigest()
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        payload = json.dumps({"sha256": sent}).encode()
        conn.request(
            "POST",
            f"/v1/checkpoints/{cid}/commit",
            body=payload,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
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
    return {"bytes": size, "sha256": sent, "started": t0, "ended": time.time()}


def _early_answer(conn: http.client.HTTPConnection) -> str:
    try:
        resp = conn.getresponse()
        body = json.loads(resp.read() or b"{}")
        return str(body.get("error", {}).get("message", ""))
    except (OSError, ValueError, http.client.HTTPException):
        return ""


def receive(stream: IO[bytes], length: int, dest: Path) -> dict[str, Any]:
    """Write ``length`` bytes from ``stream`` to ``dest.part`` (owner-only), hashing them."""
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    got = 0
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            while got < length:
                block = stream.read(min(CHUNK, length - got))
                if not block:
                    break
                h.update(block)
                f.write(block)
                got += len(block)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise TransportError(
            f"writing {dest.name} failed after {got} bytes: {e}", hint="is the target node's disk full?"
        ) from e
    if got != length:
        part.unlink(missing_ok=True)
        raise TransportError(f"the checkpoint stream ended after {got} of {length} bytes")
    part.with_name(part.name + ".sha256").write_text(h.hexdigest())
    return {"bytes": got, "sha256": h.hexdigest()}


def commit(dest: Path, sha256: str) -> dict[str, Any]:
    """Accept ``dest.part`` as ``dest`` only if the sender's digest equals the one computed here."""
    part = dest.with_name(dest.name + ".part")
    mark = part.with_name(part.name + ".sha256")
    try:
        have = mark.read_text().strip()
    except OSError as e:
        raise TransportError(f"no received checkpoint {dest.name} to commit") from e
    if have != sha256:
        part.unlink(missing_ok=True)
        mark.unlink(missing_ok=True)
        raise TransportError(
            f"checkpoint {dest.name} arrived as sha256:{have} but was sent as sha256:{sha256}; "
            "refusing to restore from it",
            hint="the stream was corrupted or tampered with",
        )
    part.rename(dest)
    mark.unlink()
    return {"sha256": have}
