"""Hosts from an inventory as the engine's ``Cluster``: the controller reaches each host's agent
over TCP with its own certificate (``hosts.identities``), and is itself the observer: it probes and
reads the workloads from where it runs, as their users would.

Routers: ``none`` (the address does not move: a workload answers at its new host's address after a
migration, the published ports re-created there) and ``l2`` (its address on a segment every host
shares moves with it, ``hosts.routers``) and ``static`` (a route to the host on the router the
inventory names, whose agent is the lab's LAN agent's kind: ``client.LanClient``).
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from podmigrate.agent.probe import Probe, fetch
from podmigrate.client import AgentClient, LanClient
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.hosts import identities
from podmigrate.hosts.inventory import AGENT_PORT, ROUTER, Inventory
from podmigrate.hosts.routers import L2Router, NoRouter

BUILT_ROUTERS = ("none", "l2", "static")


class LocalObserver:
    """The controller as the workloads' client: HTTP reads and probes from this machine."""

    def __init__(self) -> None:
        self.probes: dict[str, Probe] = {}
        self._lock = threading.Lock()

    def get(self, url: str, timeout: float = 30.0) -> dict[str, Any]:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise UsageError(f"the controller reads http:// URLs only, not {url!r}")
        return fetch(u.hostname, u.port or 80, (u.path or "/") + (f"?{u.query}" if u.query else ""), timeout)

    def start_probe(self, probe: dict[str, Any]) -> str:
        pr = Probe(str(probe["host"]), int(probe["port"]), probe.get("path", "/healthz"),
                   float(probe.get("interval", 0.02)), float(probe.get("timeout", 1.0)))  # fmt: skip
        with self._lock:
            self.probes[pr.id] = pr
        return pr.id

    def _probe(self, probe_id: str) -> Probe:
        with self._lock:
            if probe_id not in self.probes:
                raise UsageError(f"no probe {probe_id}")
            return self.probes[probe_id]

    def probe_records(self, probe_id: str) -> list[dict[str, Any]]:
        return self._probe(probe_id).snapshot()

    def stop_probe(self, probe_id: str) -> list[dict[str, Any]]:
        pr = self._probe(probe_id)
        with self._lock:
            self.probes.pop(probe_id, None)
        return pr.stop(wait=False)

    def cancel_probe(self, probe_id: str) -> None:
        with self._lock:
            pr = self.probes.pop(probe_id, None)
        if pr is not None:
            pr.stop(wait=False)

    def close(self) -> None:
        for probe_id in list(self.probes):
            self.cancel_probe(probe_id)


class Hosts:
    """An inventory's hosts (``hosts.inventory``), reached by their agents' addresses."""

    def __init__(self, inv: Inventory):
        self.inv = inv
        self.name = inv.path.stem
        self.dir: Path = inv.state
        self._tls: ssl.SSLContext | None = None

    @property
    def nodes(self) -> list[str]:
        return [h.name for h in self.inv.hosts]

    @property
    def registry(self) -> str:
        if not self.inv.registry:
            raise UsageError(
                f"{self.inv.path} names no registry: the registry transport needs one",
                hint='use --transport stream (agent to agent), or add registry = "host:port" to the inventory',
            )
        return self.inv.registry

    @property
    def workload_network(self) -> str:
        return self.inv.network

    def tls(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = identities.controller(self.inv).client_context()
        return self._tls

    def agent(self, name: str, timeout: float = 900.0) -> AgentClient:
        return self._client(name, self.inv.host(name).address, timeout)

    def _client(self, name: str, address: str, timeout: float) -> AgentClient:
        return AgentClient(
            name,
            None,
            "",
            timeout,
            base_url=f"https://{address}:{AGENT_PORT}",
            tls=self.tls(),
            unreachable_hint=f"on {name}: systemctl status podmigrate-agent; TCP {AGENT_PORT} must be open to "
            "the controller and the other hosts (docs/hosts.md)",
        )

    def node_address(self, node: str) -> str:
        return self.inv.host(node).address

    def is_service_address(self, ip: str) -> bool:
        return False  # router none holds no address for a workload

    @property
    def moves_addresses(self) -> bool:
        return self.inv.router != "none"

    @property
    def shared_segment(self) -> bool:
        return self.inv.router == "l2"

    def traffic(self) -> NoRouter | L2Router | LanClient:
        self.require_router()
        if self.inv.router == "static":  # its agent routes each service address to a host
            return LanClient(self._client(ROUTER, self.inv.router_address or "", 60), self.node_address)
        return L2Router(self.nodes, self.agent) if self.inv.router == "l2" else NoRouter()

    def observer(self) -> LocalObserver:
        return LocalObserver()

    def require_router(self) -> None:
        if self.inv.router not in BUILT_ROUTERS:
            raise UsageError(
                f"{self.inv.path}: router {self.inv.router!r} is not built for hosts yet",
                hint='use router = "none" (the workload answers at its new host\'s address) or "l2"',
            )

    def require_up(self) -> None:
        """The router is one podmigrate has, and every host's agent answers the controller; an error
        names those that do not, and why."""
        self.require_router()
        if down := {name: h["error"] for name, h in self.status().items() if not h["up"]}:
            raise PodmigrateError(
                f"agents not answering: {', '.join(f'{n} ({why})' for n, why in down.items())}",
                hint=f"on each: systemctl status podmigrate-agent; the bundle from `podmigrate hosts init "
                f"{self.inv.path}` installed with `podmigrate hosts install-agent`",
            )

    def status(self) -> dict[str, dict[str, Any]]:
        """Each host's agent's answer to ``/v1/info`` (its runtime and CRIU), and the static router's,
        or why it gave none."""
        got: dict[str, dict[str, Any]] = {}
        for name, address in ((m.name, m.address) for m in self.inv.machines()):
            try:
                with contextlib.closing(self._client(name, address, 10)) as a:
                    got[name] = {"up": True, "address": address, **a.get("/v1/info")}
            except PodmigrateError as e:
                got[name] = {"up": False, "address": address, "error": e.message}
        return got
