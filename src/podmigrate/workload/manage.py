"""Start, find, read and stop workloads in a lab, through the node agents and the LAN agent.

A workload is a container (or, with a sidecar, a pod) on one node, reached from the LAN at its own
address (its *service address*): the LAN routes that /32 to the node that runs it. Workloads are
found by asking every node's agent, never from a local record, so containers a user started by
hand with podman are found the same way.
"""

from __future__ import annotations

import time
from typing import Any

from podmigrate import cordon, layout, names
from podmigrate.claims import Claims
from podmigrate.engine.cluster import Cluster
from podmigrate.engine.inventory import (
    LABEL_KIND,
    LABEL_PORT,
    LABEL_PROBE,
    Located,
    inventory,
    locate,
    outside_get,
)
from podmigrate.engine.inventory import read_state as read_state_from
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.lab.cluster import Lab, Report
from podmigrate.workload.image import ensure_workload_image

__all__ = ["LABEL_KIND", "LABEL_PORT", "LABEL_PROBE", "Located", "inventory", "locate"]
lan_get = outside_get  # a GET from the LAN, outside the nodes


def read_state(lab: Cluster, ip: str, port: int = 8000, timeout: float = 120.0) -> dict[str, Any] | None:
    """The workload's /state through its service address, or None when it does not answer."""
    observer = lab.observer()
    try:
        return read_state_from(observer, ip, port, timeout)
    finally:
        observer.close()


def set_route(lab: Cluster, ip: str, node: str) -> dict[str, Any]:
    lan = lab.agent("lan")
    try:
        res: dict[str, Any] = lan.put(f"/v1/routes/{ip}", {"via": layout.node_ip(node)})
        return res
    finally:
        lan.close()


def start(
    lab: Lab,
    name: str,
    node: str,
    heap_mb: int,
    sidecar: bool = False,
    seed: int = 1234,
    wait: float = 300.0,
    ip: str | None = None,
    report: Report = lambda _m: None,
) -> dict[str, Any]:
    """Start stream-server (with ``sidecar``, a pod) on ``node``, its image loaded first if need be; its state."""
    if heap_mb <= 0:
        raise UsageError(f"heap size must be a positive number of MB, not {heap_mb}", hint="for example --heap-mb 256")
    names.name(name)
    lab.require_up()
    if node not in lab.nodes:
        raise UsageError(
            f"there is no node {node!r} in lab {lab.name!r}", hint=f"its nodes are: {', '.join(lab.nodes)}"
        )
    cordon.refuse_if_cordoned(lab, node, "starting a workload")
    inv = inventory(lab)
    taken = {c["name"] for cs in inv.values() for c in cs} | {c["pod"] for cs in inv.values() for c in cs}
    wanted = {name, f"{name}-server", f"{name}-sidecar"} if sidecar else {name}
    if wanted & taken:
        raise UsageError(
            f"the name {name!r} is already used in lab {lab.name!r}",
            hint=f"pick another name, or stop it first: podmigrate workload stop {name}",
        )
    image = ensure_workload_image(lab, report)
    labels = {LABEL_KIND: "stream-server", LABEL_PORT: "8000", LABEL_PROBE: "/healthz"}
    env = {"HEAP_MB": str(heap_mb), "SEED": str(seed)}
    agent = lab.agent(node)
    try:
        if sidecar:
            agent.post("/v1/pods", {"name": name, "network": layout.WORKLOAD_NETWORK})
            agent.post(
                "/v1/containers",
                {
                    "name": f"{name}-server",
                    "image": image,
                    "pod": name,
                    "env": {**env, "LISTEN": "127.0.0.1:8090"},
                    "labels": labels,
                },
            )
            info = agent.post(
                "/v1/containers",
                {
                    "name": f"{name}-sidecar",
                    "image": image,
                    "pod": name,
                    "labels": labels,
                    "command": ["python3", "-u", "/app/sidecar.py"],
                    "env": {"LISTEN": "0.0.0.0:8000", "UPSTREAM": "127.0.0.1:8090"},
                },
            )
        else:
            spec: dict[str, Any] = {
                "name": name,
                "image": image,
                "env": env,
                "labels": labels,
                "network": layout.WORKLOAD_NETWORK,
            }
            if ip:
                if not layout.in_workload_subnet(ip):
                    raise UsageError(f"{ip} is not in the workload subnet {layout.WORKLOAD_SUBNET}")
                spec["ip"] = ip
            info = agent.post("/v1/containers", spec)
    finally:
        agent.close()
    ip = info["ips"][0]
    set_route(lab, ip, node)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if lan_get(lab, f"http://{ip}:8000/healthz", timeout=2)["ok"]:
            return state(lab, f"{name}-server" if sidecar else name)
        time.sleep(0.2)
    raise PodmigrateError(
        f"workload {name!r} started on {node} but did not answer on {ip}:8000 within {wait:.0f}s",
        hint=f"look at: podmigrate lab exec {node} -- podman logs {name + '-server' if sidecar else name}",
    )


def state(lab: Cluster, name: str) -> dict[str, Any]:
    loc = locate(lab, name)
    if not loc.ips:
        raise UsageError(f"container {name!r} on {loc.node} has no network address to read state from")
    ip = loc.ips[0]
    port = loc.port or 8000
    data = read_state(lab, ip, port)
    if data is None:
        raise PodmigrateError(
            f"workload {name!r} on {loc.node} does not answer at {ip}:{port}/state",
            hint="is it a stream-server workload? is it still starting?",
        )
    return {**data, "name": name, "node": loc.node, "ip": ip, "service": f"http://{ip}:{port}"}


def stop(lab: Cluster, name: str) -> dict[str, Any]:
    Claims(lab.dir).refuse_if_busy(f"stop {name!r}", {name})  # it would delete the rollback copy
    inv = inventory(lab)
    removed: list[str] = []
    ips: set[str] = set()
    for node, ctrs in inv.items():
        for c in ctrs:
            pod = c["pod"]
            if c["name"] == name or (pod and c["name"] in (f"{name}-server", f"{name}-sidecar")):
                agent = lab.agent(node)
                try:
                    agent.delete(f"/v1/containers/{name if pod else c['name']}")
                finally:
                    agent.close()
                ips.update(c["ips"])
                removed.append(f"{node}/{c['name']}")
    if not removed:
        raise UsageError(
            f"no workload named {name!r} in lab {lab.name!r}", hint="list containers with: podmigrate lab status"
        )
    lan = lab.agent("lan")
    try:
        for ip in ips:
            lan.delete(f"/v1/routes/{ip}")
    finally:
        lan.close()
    return {"removed": removed, "routes_removed": sorted(ips)}
