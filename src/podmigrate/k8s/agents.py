"""The operator's side of the node agents: find the DaemonSet pod on a node and call it.

Neighbours: ``k8s.agent`` is what answers; ``client.AgentClient`` does the HTTP and maps errors
(the lab's controller uses the same client over Unix sockets); ``k8s.phases`` calls ``Agents.call``.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from dataclasses import dataclass, field
from typing import Any

from podmigrate.client import AgentClient
from podmigrate.errors import AgentError
from podmigrate.k8s import api as k
from podmigrate.k8s.policy import Policy

AGENT_LABELS = "app.kubernetes.io/name=podmigrate-agent"


@dataclass
class Config:
    registry: str = "registry.podmigrate-system.svc:5000/checkpoints"
    agent_namespace: str = "podmigrate-system"
    agent_token: str = ""
    agent_port: int = 7070
    poll_s: float = 0.5
    # while the Service has no ready pod (isolate's wait, the copy becoming Ready): every poll interval
    # there is blackout a client sees, so these few seconds poll the API server 20 times a second
    blackout_poll_s: float = 0.05
    # where no kube-proxy healthz answers: how long the Services proxies are given to follow (k8s.proxies)
    drain_s: float = 2.0
    # kube-proxy's minSyncPeriod (its default): a cutover within this of its last write waits for the rest
    proxy_min_sync_s: float = 1.0
    allowed_registries: tuple[str, ...] = ()  # empty: only ``registry``
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    # mutual TLS to the agents: the CA that signed their certificates, and the operator's own
    agent_ca: str = ""
    agent_cert: str = ""
    agent_key: str = ""
    # agents are dialled at their pod IPs, which no certificate made before the pod can name: with a CA
    # that signs only podmigrate's agents and operator, the chain is the identity (False in clusters)
    agent_check_hostname: bool = True
    # the operator's master key (64 hex, from a Secret only the operator mounts): each migration's key
    # is derived from it and its id, so a restarted operator opens what the one before it sealed
    seal_master: str = field(default="", repr=False)

    def policy(self) -> Policy:
        return Policy.of(self.allowed_registries or (self.registry,), self.namespaces or None)

    def seal_key(self, migration_id: str) -> str | None:
        """The key that seals migration ``migration_id``'s checkpoint images; None without a master key."""
        if not self.seal_master:
            return None
        master = bytes.fromhex(self.seal_master)
        return hmac.new(master, f"podmigrate migration {migration_id}".encode(), hashlib.sha256).hexdigest()

    def agent_tls(self) -> ssl.SSLContext | None:
        if not self.agent_ca:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.agent_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.agent_check_hostname  # verify_mode stays CERT_REQUIRED either way
        if self.agent_cert:
            ctx.load_cert_chain(self.agent_cert, self.agent_key or None)
        return ctx


@dataclass
class Agents:
    """Finds the node agent (DaemonSet pod) on a node and calls it."""

    api: k.KubeAPI
    config: Config
    clients: dict[str, AgentClient] = field(default_factory=dict)
    _tls: ssl.SSLContext | None = None

    def url(self, node: str) -> str:
        for pod in self.api.list(
            k.pods(self.config.agent_namespace), label_selector=AGENT_LABELS, field_selector=f"spec.nodeName={node}"
        ):
            if (pod.get("spec") or {}).get("nodeName") != node or not k.pod_ready(pod):
                continue  # field selectors are a server courtesy: check again
            port = self.config.agent_port
            for c in pod["spec"].get("containers", []):
                for p in c.get("ports") or []:
                    if p.get("name") == "agent":
                        port = int(p["containerPort"])
            scheme = "https" if self.config.agent_ca else "http"
            return f"{scheme}://{pod['status']['podIP']}:{port}"
        raise AgentError(
            f"no ready podmigrate agent on node {node!r} (namespace {self.config.agent_namespace})",
            hint="is the podmigrate-agent DaemonSet scheduled there? check taints and tolerations",
            details={"node": node},
        )

    def info(self, node: str) -> dict[str, Any]:
        """The agent's ``GET /v1/info``: its checkpoint directory, archives, restore handler."""
        out: dict[str, Any] = self._client(node, 900.0).get("/v1/info")
        return out

    def call(self, node: str, path: str, body: dict[str, Any], timeout: float = 900.0) -> Any:
        return self._client(node, timeout).post(path, body)

    def call_apart(self, node: str, url: str, path: str, body: dict[str, Any], timeout: float = 900.0) -> Any:
        """``call`` on a connection of its own, to the agent at ``url`` (``url(node)``, found beforehand):
        for calls made at the same time from several threads, which share no connection or API read."""
        client = self._new(node, url, timeout)
        try:
            return client.post(path, body)
        finally:
            client.close()

    def _client(self, node: str, timeout: float) -> AgentClient:
        url = self.url(node)
        if url not in self.clients:
            self.clients[url] = self._new(node, url, timeout)
        return self.clients[url]

    def _new(self, node: str, url: str, timeout: float) -> AgentClient:
        if self._tls is None:
            self._tls = self.config.agent_tls()  # one context (and one read of the key) for all agents
        return AgentClient(
            node,
            None,
            self.config.agent_token,
            timeout,
            base_url=url,
            tls=self._tls,
            unreachable_hint="is the agent pod running? kubectl -n podmigrate-system get pods -o wide",
        )

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
