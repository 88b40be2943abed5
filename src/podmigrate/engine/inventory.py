"""Where the workloads are: every node's containers as its agent lists them (never a local record, so
a container a user started by hand with podman is found the same way), the one a name runs as, and
reads of a service address from outside the nodes (the cluster's observer).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from podmigrate.engine.cluster import Cluster, Observer
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.runtime.base import ContainerInfo

LABEL_KIND = "podmigrate.workload"
LABEL_PORT = "podmigrate.port"
LABEL_PROBE = "podmigrate.probe"


@dataclass
class Located:
    node: str
    container: ContainerInfo
    others: list[tuple[str, ContainerInfo]]  # stopped copies elsewhere (leftovers of a failed run)

    @property
    def ips(self) -> list[str]:
        return self.container["ips"]

    @property
    def port(self) -> int | None:
        p = self.container["labels"].get(LABEL_PORT)
        return int(p) if p else None

    @property
    def probe_path(self) -> str | None:
        return self.container["labels"].get(LABEL_PROBE)


def inventory(lab: Cluster) -> dict[str, list[ContainerInfo]]:
    """Every node's containers, the nodes asked at once (in the nodes' order)."""

    def containers(n: str) -> list[ContainerInfo]:
        agent = lab.agent(n)
        try:
            found: list[ContainerInfo] = agent.get("/v1/containers")
            return found
        finally:
            agent.close()

    with ThreadPoolExecutor(max(1, min(8, len(lab.nodes))), "inventory") as pool:
        return dict(zip(lab.nodes, pool.map(containers, lab.nodes), strict=True))


def locate(lab: Cluster, name: str, inv: dict[str, list[ContainerInfo]] | None = None) -> Located:
    """The node running container (or pod) ``name``; UsageError if it runs nowhere."""
    inv = inv if inv is not None else inventory(lab)
    found: list[tuple[str, ContainerInfo]] = []
    for node, ctrs in inv.items():
        for c in ctrs:
            if c["name"] == name or (c["id"].startswith(name) and len(name) >= 12):
                found.append((node, c))
    if not found and any(c["name"] == f"{name}-server" for cs in inv.values() for c in cs):
        return locate(lab, f"{name}-server", inv)  # a pod started with --sidecar: its server
    running = [f for f in found if f[1]["state"] == "running"]
    if not found:
        raise UsageError(
            f"no container named {name!r} on any node of lab {lab.name!r}",
            hint="list containers with: podmigrate lab status",
        )
    if len(running) > 1:
        raise PodmigrateError(
            f"container {name!r} runs on {len(running)} nodes at once: {', '.join(n for n, _ in running)}",
            hint="stop all but one copy",
        )
    if not running:
        node, c = found[0]
        raise UsageError(
            f"container {name!r} exists on {node} but is {c['state']}, not running",
            hint=f"start it, or remove it: podmigrate lab exec {node} -- podman rm {name}",
        )
    node, c = running[0]
    return Located(node, c, [f for f in found if f is not running[0]])


def outside_get(lab: Cluster, url: str, timeout: float = 30.0) -> dict[str, Any]:
    """One GET of ``url`` from outside the nodes (the cluster's observer)."""
    observer = lab.observer()
    try:
        return observer.get(url, timeout)
    finally:
        observer.close()


def read_state(observer: Observer, ip: str, port: int = 8000, timeout: float = 120.0) -> dict[str, Any] | None:
    """The workload's /state through its service address, or None when it does not answer."""
    res = observer.get(f"http://{ip}:{port}/state", timeout=timeout)
    if not res.get("ok"):
        return None
    data: dict[str, Any] = json.loads(res["body"])
    return data
