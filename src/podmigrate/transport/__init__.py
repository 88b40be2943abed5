"""Transports: how checkpoint bytes move from the source node to the target node (standard library only).

``registry`` packages a checkpoint as an OCI image (the format CRI-O restores from) and moves it
through an OCI registry (client in ``oci``); ``stream`` and ``archive`` send it agent to agent. Each
is a sibling implementing ``base.Transport``; ``TRANSPORTS`` names them as the engine does.
"""

from __future__ import annotations

from podmigrate.errors import UsageError
from podmigrate.transport.archive import ArchiveTransport
from podmigrate.transport.base import Sent, Transport
from podmigrate.transport.registry import RegistryTransport
from podmigrate.transport.stream import StreamTransport

__all__ = ["TRANSPORTS", "ArchiveTransport", "RegistryTransport", "Sent", "StreamTransport", "Transport", "get"]

# by the names ``podmigrate migrate --transport`` takes; each is built with what it needs to send
TRANSPORTS: dict[str, type[Transport]] = {
    "registry": RegistryTransport,
    "stream": StreamTransport,
    "archive": ArchiveTransport,
}


def get(name: str) -> type[Transport]:
    if name not in TRANSPORTS:
        raise UsageError(f"unknown transport {name!r}", hint=f"transports: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]
