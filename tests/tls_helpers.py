"""What the tests that need an endpoint on loopback use (``test_registry_auth``, ``test_security``,
``test_agent_http``, ``test_k8s_security``): a free port, a self-signed certificate for 127.0.0.1
(openssl), and a server run in a thread."""

from __future__ import annotations

import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["free_port", "self_signed_cert", "serving"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 of the calling thread's network namespace."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed_cert(directory: Path, name: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed serving certificate for 127.0.0.1, its own CA: one TLS endpoint, nothing else."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    if not cert.exists():
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        key.chmod(0o600)
    return cert, key


@contextmanager
def serving(server: socketserver.BaseServer) -> Iterator[int]:
    """Serve ``server`` (bound to 127.0.0.1) in a thread; yields its port; shuts it down after."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])  # type: ignore[index]
    finally:
        server.shutdown()
        server.server_close()
