"""The client of node agents: HTTP over each agent's Unix socket (or a URL), errors rebuilt as raised;
the LAN agent's as the engine's router and observer (``LanClient``).

The socket files live in the lab's state directory, which the agents see through a bind mount, so
the host reaches agents in other network namespaces without joining them.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from podmigrate.errors import AgentError, PodmigrateError


@functools.cache
def _unused_tls() -> ssl.SSLContext:
    """What an httpx transport over a Unix socket holds but never uses: made once per process, not
    once per client (loading the CA bundle took 26 ms, four clients a migration)."""
    return ssl.create_default_context()


class AgentClient:
    """One agent, over its Unix socket (``socket_path``), a URL (``base_url``: agent to agent, the
    Kubernetes operator; ``https://`` with ``tls`` holding the CA and this side's client certificate)
    or any httpx transport (``transport``: the fake agents of the unit tests)."""

    def __init__(
        self,
        name: str,
        socket_path: Path | None,
        token: str,
        timeout: float = 900.0,
        *,
        base_url: str = "http://agent",
        transport: httpx.BaseTransport | None = None,
        tls: ssl.SSLContext | None = None,
        unreachable_hint: str = "check `podmigrate lab status`; `podmigrate lab up` restarts missing agents",
    ):
        self.name = name
        self.unreachable_hint = unreachable_hint
        self.socket_path = socket_path
        self.base_url = base_url
        self.channel = _channel(socket_path, base_url, transport, tls, token)
        if transport is None and socket_path is not None:
            transport = httpx.HTTPTransport(uds=str(socket_path), verify=_unused_tls())
        self._http = httpx.Client(
            transport=transport,
            base_url=base_url,
            timeout=httpx.Timeout(timeout, connect=5.0),
            # over TCP the client certificate in ``tls`` is the identity; the token is for the
            # Unix socket and the Kubernetes agent's ServiceAccount-style setups
            headers={"Authorization": f"Bearer {token}"} if token else {},
            verify=tls if tls is not None else True,
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
            where = f" at {self.base_url}" if self.socket_path is None else ""
            raise AgentError(
                f"agent {self.name} unreachable{where} ({type(e).__name__}: {e})",
                hint=self.unreachable_hint,
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


def _channel(
    socket_path: Path | None,
    base_url: str,
    transport: httpx.BaseTransport | None,
    tls: ssl.SSLContext | None,
    token: str,
) -> str:
    """How this client reaches its agent, for records: a Unix socket, TLS with this side's
    certificate, plain HTTP, or a transport of the caller's (the unit tests' in-process agents);
    with the bearer token when one is sent."""
    if socket_path is not None:
        how = "unix socket"
    elif transport is not None:
        how = f"{type(transport).__name__}"
    elif base_url.startswith("https://"):
        how = "mutual TLS" if tls is not None else "TLS"
    else:
        how = "plain HTTP"
    return f"{how} + token" if token else how


class LanClient:
    """The lab's LAN agent (``agent.lan``) as the engine's ``Router`` and ``Observer``
    (``engine.cluster``): it routes the service addresses and probes them from outside the nodes."""

    def __init__(self, lan: AgentClient, node_address: Callable[[str], str]):
        self.lan = lan
        self.node_address = node_address

    def switch(self, address: str, node: str, drain: bool = False) -> dict[str, Any]:
        res: dict[str, Any] = self.lan.put(f"/v1/routes/{address}", {"via": self.node_address(node), "drain": drain})
        return res

    def end_drain(self, address: str, timeout: float) -> dict[str, Any]:
        res: dict[str, Any] = self.lan.post(f"/v1/routes/{address}/drain", {"timeout": timeout}, timeout=timeout + 30)
        return res

    def routes(self) -> list[dict[str, Any]]:
        return list(self.lan.get("/v1/routes"))

    def remove(self, address: str) -> None:
        self.lan.delete(f"/v1/routes/{address}")

    def get(self, url: str, timeout: float = 30.0) -> dict[str, Any]:
        res: dict[str, Any] = self.lan.post("/v1/http", {"url": url, "timeout": timeout}, timeout=timeout + 10)
        return res

    def start_probe(self, probe: dict[str, Any]) -> str:
        return str(self.lan.post("/v1/probes", dict(probe))["id"])

    def probe_records(self, probe_id: str) -> list[dict[str, Any]]:
        return list(self.lan.get(f"/v1/probes/{probe_id}"))

    def stop_probe(self, probe_id: str) -> list[dict[str, Any]]:
        return list(self.lan.post(f"/v1/probes/{probe_id}/stop", {"wait": False}))

    def cancel_probe(self, probe_id: str) -> None:
        self.lan.delete(f"/v1/probes/{probe_id}")

    def close(self) -> None:
        self.lan.close()
