"""The host-side client of node agents: HTTP over each agent's Unix socket, errors rebuilt as raised.

The socket files live in the lab's state directory, which the agents see through a bind mount, so
the host reaches agents in other network namespaces without joining them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from podmigrate.errors import AgentError, PodmigrateError


class AgentClient:
    def __init__(self, name: str, socket_path: Path, token: str, timeout: float = 900.0):
        self.name = name
        self.socket_path = socket_path
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(socket_path)),
            base_url="http://agent",
            timeout=httpx.Timeout(timeout, connect=5.0),
            headers={"Authorization": f"Bearer {token}"},
        )

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        try:
            kw: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kw["timeout"] = timeout
            resp = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise AgentError(
                f"agent {self.name} unreachable ({type(e).__name__}: {e})",
                hint="check `podmigrate lab status`; `podmigrate lab up` restarts missing agents",
                details={"node": self.name},
            ) from e
        try:
            data = resp.json()
        except ValueError as e:
            raise AgentError(f"agent {self.name} sent a non-JSON answer ({resp.status_code})") from e
        if resp.status_code != 200:
            raise PodmigrateError.from_wire(data.get("error") or {"message": str(data)})
        return data

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.call("GET", path, timeout=timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.call("POST", path, body or {}, timeout=timeout)

    def put(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.call("PUT", path, body or {})

    def delete(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.call("DELETE", path, body)
