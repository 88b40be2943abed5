"""The example workload on the Kubernetes lab, and driving PodLiveMigrations to their end.

The pod is ``deploy/kubernetes/examples/heapsrv.yaml`` made for the lab: the heap server and its
sidecar from the lab's workload image (``localhost:5000/...`` on every node), ``GET /state`` through
the sidecar at the pod's address. Used by the tests, ``podmigrate demo --kubernetes`` and
``podmigrate bench k8s``; the calling thread must be in the LAN (``KubeLab.start`` put it there).
"""

from __future__ import annotations

from typing import Any

import httpx

from podmigrate import layout
from podmigrate.k8s import api as k
from podmigrate.lab.containerd import NODE_REGISTRY
from podmigrate.polling import poll
from podmigrate.workload.image import workload_image

NS = "default"
PLMS = f"/apis/podmigrate.io/v1alpha1/namespaces/{NS}/podlivemigrations"
FINAL = ("Completed", "Failed", "RolledBack")


def image() -> str:
    return workload_image().replace(layout.REGISTRY, NODE_REGISTRY)


def example_pod(name: str, node: str, heap_mb: int, port: int = 8000) -> dict[str, Any]:
    """``port``: the sidecar's (the heap server's is 90 above it); the lab's pods share their node's
    network namespace, so two on one node need two ports."""
    heap = f"127.0.0.1:{port + 90}"
    env = [{"name": "HEAP_MB", "value": str(heap_mb)}, {"name": "LISTEN", "value": heap}]
    sidecar = [{"name": "LISTEN", "value": f"0.0.0.0:{port}"}, {"name": "UPSTREAM", "value": heap}]
    need = {"requests": {"memory": f"{heap_mb + 32}Mi"}}  # what the scheduler and an evacuation count
    return {
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "server",
                    "image": image(),
                    "command": ["python3", "-u", "/app/heapsrv.py"],
                    "env": env,
                    "resources": need,
                },
                {
                    "name": "sidecar",
                    "image": image(),
                    "command": ["python3", "-u", "/app/sidecar.py"],
                    "env": sidecar,
                    "resources": {"requests": {"memory": "32Mi"}},
                },
            ],
        },
    }


def state(node: str, timeout: float = 120, port: int = 8000) -> dict[str, Any]:
    """The heap server's ``/state`` (heap SHA-256, start time, counter) at ``node``'s address."""

    def get() -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = httpx.get(f"http://{layout.node_ip(node)}:{port}/state", timeout=5).json()
            return out
        except (httpx.HTTPError, ValueError):
            return None

    out: dict[str, Any] = poll(get, timeout, f"the heap server on {node}", 0.2)
    return out


def start_example(
    api: k.KubeAPI, name: str = "heapsrv", node: str = "node-a", heap_mb: int = 16, port: int = 8000
) -> dict[str, Any]:
    """The pod and its Service ``web``; its state once it answers."""
    api.create(k.pods(NS), example_pod(name, node, heap_mb, port))
    if api.get(k.services(NS, "web")) is None:
        svc = {
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80}]},
        }
        api.create(k.services(NS), svc)
    poll(lambda: k.pod_ready(api.get(k.pods(NS, name)) or {}), 300, f"pod {name} ready")
    return state(node, timeout=60 + heap_mb / 4, port=port)


def migrate(api: k.KubeAPI, name: str, spec: dict[str, Any]) -> None:
    meta = {"name": name, "namespace": NS, "resourceVersion": "1"}
    body = {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration", "metadata": meta, "spec": spec}
    api.create(PLMS, body)


def status(api: k.KubeAPI, name: str) -> dict[str, Any]:
    return (api.get(f"{PLMS}/{name}") or {}).get("status") or {}


def wait_final(api: k.KubeAPI, name: str, timeout: float = 600, on_change: Any = None) -> dict[str, Any]:
    """The migration's status once it is Completed, Failed or RolledBack; ``on_change(status)`` at
    every phase change, for a progress display."""
    seen = ""

    def done() -> dict[str, Any] | None:
        nonlocal seen
        st = status(api, name)
        if on_change and st.get("phase", "") != seen:
            seen = st.get("phase", "")
            on_change(st)
        return st if st.get("phase") in FINAL else None

    out: dict[str, Any] = poll(done, timeout, f"PodLiveMigration {name}", 0.1)
    return out
