"""The ``archive`` transport: podman's whole export, copied agent to agent.

It differs from sibling ``transport.stream`` only in what the archive holds: no page server took the
memory pages during the dump, so they travel inside the export. The bytes go the same way (stream's
``send`` -> the target's upload route -> commit: the seal's proof, or the end-to-end SHA-256 when
unsealed). Pods always move so: one export per member.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from podmigrate.transport.stream import StreamTransport

if TYPE_CHECKING:
    from podmigrate.transport.base import Transport


class ArchiveTransport(StreamTransport):
    """Sends ``<id>.tar`` (a whole export) to the agent on host ``to``: as ``StreamTransport`` does."""


if TYPE_CHECKING:

    def _conforms(t: ArchiveTransport) -> Transport:
        return t
