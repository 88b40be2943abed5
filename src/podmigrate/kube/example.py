"""The example (``deploy/kubernetes/examples``) on the lab's cluster, driven with kubectl: its pod's
state read from the LAN at the pod's address, PodLiveMigrations applied and watched to their end.
Used by ``podmigrate demo --kubernetes``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from podmigrate.kube.cluster import KubeCluster
from podmigrate.polling import poll

FINAL = ("Completed", "Failed", "RolledBack")


def get(cluster: KubeCluster, *args: str) -> dict[str, Any]:
    p = cluster.kubectl(["get", "-o", "json", *args], check=False)
    return dict(json.loads(p.stdout)) if p.returncode == 0 else {}


def ready_pod(cluster: KubeCluster, ns: str, name: str, timeout: float = 300) -> dict[str, Any]:
    """Pod ``name`` once every container is ready."""

    def ready() -> dict[str, Any] | None:
        pod = get(cluster, "pod", name, "-n", ns)
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return pod if pod and all(c.get("ready") for c in statuses) else None

    out: dict[str, Any] = poll(ready, timeout, f"pod {ns}/{name} ready")
    return out


def state(cluster: KubeCluster, pod: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """The heap server's ``/state`` (heap SHA-256, process start, counter), through its sidecar at the
    pod's address, from the lab's LAN."""
    url = f"http://{pod['status']['podIP']}:8000/state"

    def read() -> dict[str, Any] | None:
        p = cluster.lab.run("lan", ["curl", "-s", "--max-time", "3", url], check=False)
        try:
            return dict(json.loads(p.stdout)) if p.returncode == 0 else None
        except ValueError:
            return None

    out: dict[str, Any] = poll(read, timeout, f"the heap server at {url}")
    return out


def migrate(cluster: KubeCluster, ns: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}  # fmt: skip
    cluster.kubectl(["apply", "-f", "-"], input=json.dumps(body))


OnChange = Callable[[dict[str, Any]], None]


def wait_final(
    cluster: KubeCluster, ns: str, name: str, timeout: float = 1800, on_change: OnChange | None = None
) -> dict[str, Any]:
    """The migration's status once it is Completed, Failed or RolledBack; ``on_change(status)`` at each
    phase it is seen in."""
    seen = ""

    def done() -> dict[str, Any] | None:
        nonlocal seen
        st = get(cluster, "plm", name, "-n", ns).get("status") or {}
        if on_change and st.get("phase", "") != seen:
            seen = st.get("phase", "")
            on_change(st)
        return st if st.get("phase") in FINAL else None

    out: dict[str, Any] = poll(done, timeout, f"PodLiveMigration {ns}/{name}", 0.2)
    return out
