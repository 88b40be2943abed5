"""The error hierarchy, shared by the host side and the node agents (standard library only).

Every error says what failed and what to do next (``hint``)::

    PodmigrateError
    ├── UsageError          bad input; nothing was changed
    ├── LabError            the lab is not up, or cannot be set up
    │   └── PreflightError  the machine lacks something the lab needs
    ├── AgentError          a node agent is unreachable or refused a request
    ├── RuntimeBackendError Podman or CRIU failed (with their output and the CRIU log tail)
    │   └── CRIError        a CRI runtime (containerd) refused or failed an RPC (cri.client)
    ├── TransportError      moving checkpoint bytes failed (registry, digest mismatch)
    ├── RoutingError        switching the service address failed
    └── MigrationFailed     a migration stopped; ``record`` says where and what was rolled back

Agents send errors as JSON (``to_wire``); the client rebuilds the same class (``from_wire``), so a
CRIU failure on a node reaches the CLI as a ``RuntimeBackendError`` with the node's own output.
"""

from __future__ import annotations

from typing import Any


class PodmigrateError(Exception):
    """Base class: a message for people, an optional hint, and machine-readable details."""

    def __init__(self, message: str, *, hint: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details: dict[str, Any] = details or {}

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message

    def to_wire(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "message": self.message, "hint": self.hint, "details": self.details}

    @staticmethod
    def from_wire(data: dict[str, Any]) -> PodmigrateError:
        cls = _KINDS.get(str(data.get("kind")), PodmigrateError)
        return cls(str(data.get("message", "unknown error")), hint=data.get("hint"), details=data.get("details") or {})


class UsageError(PodmigrateError):
    """The request itself is wrong (unknown node or container, bad size); nothing was changed."""


class LabError(PodmigrateError):
    """The lab is not running, or setting it up failed."""


class PreflightError(LabError):
    """The machine lacks something the lab needs (root, kernel option, CRIU, disk)."""


class AgentError(PodmigrateError):
    """A node agent could not be reached or refused the request."""


class RuntimeBackendError(PodmigrateError):
    """The container runtime (Podman, runc, CRIU) failed."""


class CRIError(RuntimeBackendError):
    """A CRI call failed: ``details`` has ``rpc``, ``code`` (the gRPC status name) and ``socket``."""

    @property
    def code(self) -> str:
        return str(self.details.get("code", ""))


class TransportError(PodmigrateError):
    """Checkpoint bytes could not be moved, or arrived different from what was sent."""


class RoutingError(PodmigrateError):
    """The service address could not be switched."""


class MigrationFailed(PodmigrateError):
    """A migration did not complete; ``details['record']`` holds its record after rollback."""


_KINDS: dict[str, type[PodmigrateError]] = {
    c.__name__: c
    for c in (
        PodmigrateError,
        UsageError,
        LabError,
        PreflightError,
        AgentError,
        RuntimeBackendError,
        CRIError,
        TransportError,
        RoutingError,
        MigrationFailed,
    )
}
