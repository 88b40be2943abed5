"""The ``archive`` transport: podman's whole export, copied agent to agent (standard library only).

It differs from sibling ``transport.stream`` only in what the archive holds: no page server took the
memory pages during the dump, so they travel inside the export. The bytes go the same way (stream's
``send`` -> the target's upload route -> commit with the end-to-end SHA-256). Pods always move so:
one export per member.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from podmigrate.transport import stream

if TYPE_CHECKING:
    from podmigrate.transport.base import Transport


class ArchiveTransport:
    """Sends ``<id>.tar`` (a whole export) to the agent on host ``to`` (its ``port``, with ``token``)."""

    def __init__(self, token: str, port: int):
        self.token, self.port = token, port

    def send(self, archive: Path, to: str) -> stream.Streamed:
        return stream.send(archive, to, self.port, archive.name.removesuffix(".tar"), self.token)


if TYPE_CHECKING:

    def _conforms(t: ArchiveTransport) -> Transport:
        return t
