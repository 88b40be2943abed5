"""What a transport is: how the source node sends one checkpoint archive towards the target (standard library only).

Implemented by the siblings ``transport.registry``, ``transport.stream`` and ``transport.archive``
(looked up by the engine's names in ``transport.TRANSPORTS``); the node agent (``agent.node``) sends
through it. Only the source side is common: the target *pulls* a registry image
(``RegistryTransport.fetch``), while stream and archive are *pushed* into the target's upload route
(``stream.receive``, then ``stream.commit``: what the seal proved, or the sender's SHA-256).
"""

from __future__ import annotations

from pathlib import Path
from typing import NotRequired, Protocol, TypedDict, runtime_checkable


class Sent(TypedDict):
    bytes: int  # what crossed the wire (the compressed layer, for a compressed image)
    started: float
    ended: float
    # how it crossed, as the connection that carried it was (agent to agent: "mutual TLS (TLSv1.3)")
    channel: NotRequired[str]


@runtime_checkable
class Transport(Protocol):
    """Moves one checkpoint archive from the source node to the target node."""

    def send(self, archive: Path, to: str) -> Sent:
        """Send ``archive`` (``<id>.tar``) to ``to``: an image reference for the registry, the target
        agent's host for stream and archive. Raises ``TransportError`` saying what failed."""
        ...
