"""podmigrate installed on the lab's cluster the way a user installs it on theirs.

1. the project's image from ``deploy/Containerfile`` (``kube.image``) into the lab's registry;
2. the Secrets the manifests mount, from ``podmigrate k8s secrets`` (the documented alternative to
   cert-manager; its CA and sealing key kept in ``<lab>/kube/podmigrate-ca``);
3. ``kubectl apply -k`` of a kustomization that sets the image over ``deploy/kubernetes/lab`` (the
   user's manifests, ``deploy/kubernetes/base``, with the lab's registry and host networking);
4. the operator's Deployment and the agents' DaemonSet rolled out, every pod Ready.

``example`` applies ``deploy/kubernetes/examples/heapsrv.yaml`` with the image set, as ``kubectl apply
-f`` of the user's edited copy would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from podmigrate.errors import LabError
from podmigrate.k8s import secrets
from podmigrate.kube import image
from podmigrate.kube.cluster import KubeCluster, Report

NS = secrets.NAMESPACE
BASE_IMAGE_NAME = "registry.example/podmigrate"  # what deploy/kubernetes/base names the image


def _deploy() -> Path:
    return image.source_root() / "deploy" / "kubernetes"


def kustomization(cluster: KubeCluster, ref: str) -> Path:
    """The lab's kustomization over ``deploy/kubernetes/lab``, the image set to ``ref``; its directory."""
    out = cluster.paths.host / "install"
    out.mkdir(parents=True, exist_ok=True)
    name, tag = image.node_reference(ref).rsplit(":", 1)
    body = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes no absolute path for a base
        "resources": [os.path.relpath(_deploy() / "lab", out)],
        "images": [{"name": BASE_IMAGE_NAME, "newName": name, "newTag": tag}],
    }
    (out / "kustomization.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    return out


def install(cluster: KubeCluster, report: Report = lambda _m: None, timeout: float = 300) -> dict[str, Any]:
    """podmigrate's operator and agents running on the cluster; their pods."""
    cluster.lab.require_up()
    cluster.kubeconfig()  # a clear error when the lab has no cluster
    ref = image.ensure_project_image(cluster.lab, report)
    report("the podmigrate-system namespace and its Secrets (podmigrate k8s secrets)")
    cluster.kubectl(["apply", "-f", str(_deploy() / "base" / "namespace.yaml")])
    items = secrets.manifests(cluster.paths.host / "podmigrate-ca", NS)
    cluster.kubectl(["apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    where = kustomization(cluster, ref)
    report(f"kubectl apply -k (deploy/kubernetes/lab, image {image.node_reference(ref)})")
    cluster.kubectl(["apply", "-k", str(where)])
    for what in ("deployment/podmigrate-operator", "daemonset/podmigrate-agent"):
        report(f"waiting for {what} to roll out")
        argv = ["-n", NS, "rollout", "status", what, f"--timeout={int(timeout)}s"]
        if cluster.kubectl(argv, check=False, timeout=timeout + 30).returncode:
            raise LabError(
                f"{what} did not roll out in {timeout:.0f} s",
                hint="its pods, their events and logs are in details",
                details=_why(cluster),
            )
    return pods(cluster)


def _why(cluster: KubeCluster) -> dict[str, Any]:
    """What a user would look at: the pods, the namespace's events, each pod's last log lines."""
    out: dict[str, Any] = {"pods": cluster.kubectl(["-n", NS, "get", "pods", "-o", "wide"], check=False).stdout}
    events = cluster.kubectl(["-n", NS, "get", "events", "--sort-by=.lastTimestamp"], check=False).stdout
    out["events"] = events.splitlines()[-30:]
    for name in pods(cluster):
        log = cluster.kubectl(["-n", NS, "logs", name, "--tail=30", "--all-containers"], check=False)
        prev = cluster.kubectl(["-n", NS, "logs", name, "--tail=30", "--previous"], check=False)
        out[f"log {name}"] = (log.stdout + log.stderr + prev.stdout).splitlines()[-40:]
    return out


def pods(cluster: KubeCluster) -> dict[str, Any]:
    """podmigrate's pods: name -> node, phase, ready."""
    out = json.loads(cluster.kubectl(["-n", NS, "get", "pods", "-o", "json"]).stdout)
    return {
        p["metadata"]["name"]: {
            "node": p["spec"].get("nodeName"),
            "phase": p.get("status", {}).get("phase"),
            "ready": all(c.get("ready") for c in p.get("status", {}).get("containerStatuses") or [{}]),
        }
        for p in out.get("items", [])
    }


def uninstall(cluster: KubeCluster, report: Report = lambda _m: None) -> None:
    """What ``install`` applied deleted (the CRD with it: every PodLiveMigration goes too)."""
    where = cluster.paths.host / "install"
    if (where / "kustomization.yaml").exists():
        report("kubectl delete -k (podmigrate)")
        cluster.kubectl(["delete", "-k", str(where), "--ignore-not-found", "--wait", "--timeout=120s"], timeout=180)


def example_manifests(cluster: KubeCluster, heap_mb: int | None = None, sidecar: bool = True) -> list[dict[str, Any]]:
    """``deploy/kubernetes/examples/heapsrv.yaml`` with the lab's image (and ``heap_mb``, if given);
    without its sidecar: ``single_container``."""
    ref = image.node_reference(image.ensure_project_image(cluster.lab))
    docs = [d for d in yaml.safe_load_all((_deploy() / "examples" / "heapsrv.yaml").read_text()) if d]
    for doc in docs:
        for c in doc.get("spec", {}).get("containers", []):
            if c.get("image") == "podmigrate":
                c["image"] = ref
            for env in c.get("env", []):
                if heap_mb is not None and env["name"] == "HEAP_MB":
                    env["value"] = str(heap_mb)
    return docs if sidecar else single_container(docs)


def single_container(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The example's pod as one container, the lab engine's workload: the server listens where its
    sidecar did, with the sidecar's port and readiness probe; the Service and budget unchanged."""
    for doc in docs:
        containers = doc.get("spec", {}).get("containers") or []
        side = next((c for c in containers if c["name"] == "sidecar"), None)
        if doc.get("kind") != "Pod" or side is None:
            continue
        listen = next(e["value"] for e in side["env"] if e["name"] == "LISTEN")
        server = next(c for c in containers if c["name"] == "server")
        server["env"] = [e if e["name"] != "LISTEN" else {"name": "LISTEN", "value": listen} for e in server["env"]]
        server["ports"], server["readinessProbe"] = side["ports"], side["readinessProbe"]
        doc["spec"]["containers"] = [server]
    return docs


def apply_example(
    cluster: KubeCluster, namespace: str = "default", heap_mb: int | None = None, sidecar: bool = True
) -> None:
    items = example_manifests(cluster, heap_mb, sidecar)
    cluster.kubectl(["-n", namespace, "apply", "-f", "-"],
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))  # fmt: skip


def remove_example(cluster: KubeCluster, namespace: str = "default") -> None:
    """Every PodLiveMigration of ``namespace`` and the example's pods gone (its Service and budget stay)."""
    cluster.kubectl(["delete", "plm", "--all", "-n", namespace, "--wait=true"], check=False)
    gone = ["delete", "pods", "-l", "app=heapsrv", "-n", namespace, "--grace-period=1", "--wait=true", "--timeout=300s"]
    cluster.kubectl(gone, check=False, timeout=330)
