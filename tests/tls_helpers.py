"""What the tests that need an endpoint on loopback use (``test_registry_auth``, ``test_security``,
``test_agent_http``): the Kubernetes lab's own helpers (``podmigrate.kubelab.cluster``) and a server
run in a thread."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from podmigrate.kubelab.cluster import free_port, self_signed

__all__ = ["free_port", "self_signed_cert", "serving"]


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    return self_signed(directory, "127.0.0.1")


@contextmanager
def serving(server: socketserver.BaseServer) -> Iterator[int]:
    """Serve ``server`` (bound to 127.0.0.1) in a thread; yields its port; shuts it down after."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])  # type: ignore[index]
    finally:
        server.shutdown()
        server.server_close()
