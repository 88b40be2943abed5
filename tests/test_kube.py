"""Upstream Kubernetes in the lab (real lab, real binaries of the pinned release): the control plane
comes up on the lab's LAN, reports the pinned version, refuses what its authorizers refuse, and takes
podmigrate's manifests as a real API server does (CRD schema checked, status not pruned, RBAC as
written). The first run on a machine builds the binaries (``kube.build``)."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.k8s import manifests
from podmigrate.k8s.crd import STATUS_SCHEMA
from podmigrate.kube import build
from podmigrate.kube.certs import SERVICE_CIDR
from podmigrate.kube.cluster import CONTROL_PLANE, KubeCluster
from podmigrate.kube.kubelet import KERNEL_DEFAULTS
from podmigrate.lab.containerd import NODE_REGISTRY
from podmigrate.workload.image import workload_image

from .conftest import KERNEL_BEFORE_KUBE, wait_for

pytestmark = pytest.mark.lab
DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


def kernel_settings() -> dict[str, int]:
    return {k: int(Path("/proc/sys", k).read_text()) for k in KERNEL_DEFAULTS}


def sample(schema: dict[str, Any]) -> Any:
    """A value for every field ``schema`` declares (the first of each enum)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return {"phases": [{"name": "checkpoint", "seconds": 1.25}], "undo": {"nested": [1, "two"]}}
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        if "properties" in schema:
            return {k: sample(v) for k, v in schema["properties"].items()}
        return {"one": sample(schema.get("additionalProperties") or {"type": "string"})}
    if kind == "array":
        return [sample(schema["items"])]
    if schema.get("format") == "date-time":
        return "2026-12-06T14:00:00Z"
    return {"string": "text", "number": 1.5, "integer": 7, "boolean": True}[kind or "string"]


def test_the_control_plane_is_upstreams_at_the_pinned_release(kube: KubeCluster) -> None:
    st = kube.status()
    node_side = [f"{c}-{n}" for n in ("node-a", "node-b") for c in ("kubelet", "kube-proxy")]
    assert st["components"] == {name: True for name in [*CONTROL_PLANE, *node_side]}
    assert st["version"] == build.pinned_version()
    version = json.loads(kube.kubectl(["version", "-o", "json"]).stdout)
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"] == build.pinned_version()
    # the controller-manager and the scheduler are upstream's and take part: leases, namespaces
    namespaces = kube.kubectl(["get", "namespaces", "-o", "name"]).stdout.split()
    assert {"namespace/default", "namespace/kube-system", "namespace/kube-public"} <= set(namespaces)


def test_the_real_authorizers_refuse_what_rbac_does_not_grant(kube: KubeCluster) -> None:
    kube.kubectl(["apply", "-f", "-"], input=(DEPLOY / "base" / "namespace.yaml").read_text())
    kube.kubectl(["apply", "-n", "podmigrate-system", "-f", "-"], input=(DEPLOY / "base" / "rbac.yaml").read_text())
    kube.kubectl(["create", "serviceaccount", "nobody", "-n", "default"], check=False)
    agent = "system:serviceaccount:podmigrate-system:podmigrate-agent"
    nobody = "system:serviceaccount:default:nobody"
    # the kubelet asks the API server exactly this (a SubjectAccessReview) for POST /checkpoint/...
    checkpoint = ["auth", "can-i", "create", "nodes", "--subresource", "checkpoint"]
    assert kube.kubectl([*checkpoint, "--as", agent]).stdout.strip() == "yes"
    refused = kube.kubectl([*checkpoint, "--as", nobody], check=False)
    assert refused.stdout.strip() == "no" and refused.returncode == 1
    # the agent's role is the checkpoint and nothing more
    assert kube.kubectl(["auth", "can-i", "delete", "pods", "--as", agent], check=False).stdout.strip() == "no"
    denied = kube.kubectl(["get", "pods", "-A", "--as", nobody], check=False)
    assert denied.returncode and "forbidden" in denied.stderr.lower()


def test_the_crd_takes_every_status_field_without_pruning(kube: KubeCluster) -> None:
    kube.kubectl(["apply", "-f", "-"], input=manifests.crd_yaml())
    kube.kubectl(["wait", "--for", "condition=Established", "crd/podlivemigrations.podmigrate.io", "--timeout=60s"])
    kube.kubectl(
        ["apply", "-n", "default", "-f", "-"], input=(DEPLOY / "examples" / "podlivemigration.yaml").read_text()
    )
    status = sample(STATUS_SCHEMA)
    kube.kubectl(["patch", "plm", "heapsrv-move", "-n", "default", "--subresource", "status", "--type", "merge",
                  "-p", json.dumps({"status": status})])  # fmt: skip
    got = json.loads(kube.kubectl(["get", "plm", "heapsrv-move", "-n", "default", "-o", "json"]).stdout)
    assert got["status"] == status
    # and what the schema does not allow is refused by the API server itself
    bad = kube.kubectl(["patch", "plm", "heapsrv-move", "-n", "default", "--subresource", "status", "--type",
                        "merge", "-p", json.dumps({"status": {"phase": "Teleported"}})], check=False)  # fmt: skip
    assert bad.returncode and "Unsupported value" in bad.stderr
    kube.kubectl(["delete", "plm", "heapsrv-move", "-n", "default", "--wait=true"])


def test_each_node_runs_upstreams_kubelet_over_its_containerd(kube: KubeCluster) -> None:
    nodes = json.loads(kube.kubectl(["get", "nodes", "-o", "json"]).stdout)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == kube.lab.nodes
    for n in nodes:
        info = n["status"]["nodeInfo"]
        assert info["kubeletVersion"] == build.pinned_version()
        assert info["containerRuntimeVersion"].startswith("containerd://2.1.")
        assert {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"] == "True"
    # the kubelet found its kernel settings in the node's view; the machine's were not touched
    shown = kube.lab.run("node-a", ["sh", "-c", " ".join(f"cat /proc/sys/{k};" for k in KERNEL_DEFAULTS)])
    assert [int(x) for x in shown.stdout.split()] == list(KERNEL_DEFAULTS.values())
    assert kernel_settings() == KERNEL_BEFORE_KUBE


def checkpoint(kube: KubeCluster, token: str, path: str) -> tuple[str, str]:
    """POST the kubelet's Checkpoint API on node-a with a bearer token, from the LAN: (code, body)."""
    ca = kube.paths.inside(kube.paths.host / "pki" / "ca.crt")
    url = f"https://{layout.node_ip('node-a')}:10250/checkpoint/{path}?timeout=120"
    p = kube.lab.run("lan", ["curl", "-s", "-X", "POST", "--cacert", ca, "-H", f"Authorization: Bearer {token}",
                             "-w", "\n%{http_code}", url], timeout=180)  # fmt: skip
    body, _, code = p.stdout.rpartition("\n")
    return code, body


def test_the_kubelets_checkpoint_api_is_authorized_by_the_real_api_server(kube: KubeCluster) -> None:
    kube.kubectl(["apply", "-f", "-"], input=(DEPLOY / "base" / "namespace.yaml").read_text())
    kube.kubectl(["apply", "-n", "podmigrate-system", "-f", "-"], input=(DEPLOY / "base" / "rbac.yaml").read_text())
    kube.kubectl(["create", "serviceaccount", "nobody", "-n", "default"], check=False)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "heap", "namespace": "default"},
           "spec": {"nodeName": "node-a", "hostNetwork": True,
                    "containers": [{"name": "heap", "image": workload_image().replace(layout.REGISTRY, NODE_REGISTRY),
                                    "env": [{"name": "HEAP_MB", "value": "16"}]}]}}  # fmt: skip
    kube.kubectl(["apply", "-f", "-"], input=json.dumps(pod))
    kube.kubectl(["wait", "--for", "condition=Ready", "pod/heap", "-n", "default", "--timeout=120s"])
    agent = kube.kubectl(["create", "token", "podmigrate-agent", "-n", "podmigrate-system"]).stdout.strip()
    nobody = kube.kubectl(["create", "token", "nobody", "-n", "default"]).stdout.strip()
    code, body = checkpoint(kube, nobody, "default/heap/heap")
    assert code == "403" and "forbidden" in body.lower() and "checkpoint" in body
    code, body = checkpoint(kube, agent, "default/heap/heap")
    assert code == "200", body
    (archive,) = json.loads(body)["items"]
    assert archive.startswith("/var/lib/kubelet/checkpoints/checkpoint-heap_default-heap-")
    # the archive holds the process's memory: the kubelet never deletes it, so the caller must
    listed = kube.lab.run("node-a", ["tar", "-tf", archive]).stdout.split()
    assert any(name.startswith("checkpoint/pages-") for name in listed)
    kube.lab.run("node-a", ["rm", "-f", archive])
    kube.kubectl(["delete", "pod", "heap", "-n", "default", "--wait=true"])


def test_pods_get_their_nodes_pod_network_and_cannot_open_connections_into_the_lab(kube: KubeCluster) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "netpod", "namespace": "default"},
           "spec": {"nodeName": "node-b",
                    "containers": [{"name": "heap", "image": workload_image().replace(layout.REGISTRY, NODE_REGISTRY),
                                    "env": [{"name": "HEAP_MB", "value": "16"}]}]}}  # fmt: skip
    kube.kubectl(["apply", "-f", "-"], input=json.dumps(pod))
    kube.kubectl(["wait", "--for", "condition=Ready", "pod/netpod", "-n", "default", "--timeout=120s"])
    got = json.loads(kube.kubectl(["get", "pod", "netpod", "-n", "default", "-o", "json"]).stdout)
    cidr = kube.kubectl(["get", "node", "node-b", "-o", "jsonpath={.spec.podCIDR}"]).stdout.strip()
    ip = got["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)

    # reached from the LAN through the route to its node; Ready (no readiness probe) only says the
    # container started, not that its server listens yet
    def healthz() -> str | None:
        code = kube.lab.run("lan", ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                                    f"http://{ip}:8000/healthz"], check=False).stdout  # fmt: skip
        return code if code == "200" else None

    wait_for(healthz, 60, f"the pod's server at {ip}:8000 to answer the LAN")
    # and, like any workload, it cannot open a connection to its node's agent (the nodes' guard)
    probe = "import socket; socket.create_connection(('" + layout.node_ip("node-b") + "', 7070), 3); print('open')"
    p = kube.kubectl(["exec", "netpod", "-n", "default", "--", "python3", "-c", probe], check=False)
    assert p.returncode != 0 and "open" not in p.stdout and "timed out" in p.stderr
    kube.kubectl(["delete", "pod", "netpod", "-n", "default", "--wait=true"])


def test_each_node_leases_pod_addresses_from_its_own_store_and_does_not_reuse_one_at_once(kube: KubeCluster) -> None:
    """A freed address given at once to the next pod let clients' stale conntrack entries (and
    kube-proxy's rules not yet rewritten) reach a pod they were never sent to."""
    store = "/var/lib/cni/networks/pods"

    image = workload_image().replace(layout.REGISTRY, NODE_REGISTRY)

    def start(name: str) -> str:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
               "spec": {"nodeName": "node-b", "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "heap", "image": image,
                                        "env": [{"name": "HEAP_MB", "value": "1"}]}]}}  # fmt: skip
        kube.kubectl(["apply", "-f", "-"], input=json.dumps(pod))
        kube.kubectl(["wait", "--for", "condition=Ready", f"pod/{name}", "-n", "default", "--timeout=120s"])
        return str(kube.kubectl(["get", "pod", name, "-n", "default", "-o", "jsonpath={.status.podIP}"]).stdout)

    first = start("leasepod-1")
    assert first in kube.lab.run("node-b", ["ls", store]).stdout.split()
    assert first not in kube.lab.run("node-a", ["ls", "-a", store], check=False).stdout.split()
    kube.kubectl(["delete", "pod", "leasepod-1", "-n", "default", "--wait=true"])
    assert first not in kube.lab.run("node-b", ["ls", store]).stdout.split()  # released, not leaked
    second = start("leasepod-2")
    assert second != first
    kube.kubectl(["delete", "pod", "leasepod-2", "-n", "default", "--wait=true"])


def test_kube_proxy_programs_a_services_cluster_ip_in_nftables_and_leaves_conntrack_alone(kube: KubeCluster) -> None:
    conntrack_max = Path("/proc/sys/net/netfilter/nf_conntrack_max").read_text()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "svcpod", "namespace": "default",
                                                           "labels": {"app": "svcpod"}},
           "spec": {"nodeName": "node-b",
                    "containers": [{"name": "heap", "image": workload_image().replace(layout.REGISTRY, NODE_REGISTRY),
                                    "env": [{"name": "HEAP_MB", "value": "16"}]}]}}  # fmt: skip
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svcpod", "namespace": "default"},
           "spec": {"selector": {"app": "svcpod"}, "ports": [{"port": 80, "targetPort": 8000}]}}  # fmt: skip
    kube.kubectl(["apply", "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod, svc]}))
    kube.kubectl(["wait", "--for", "condition=Ready", "pod/svcpod", "-n", "default", "--timeout=120s"])
    ip = kube.kubectl(["get", "svc", "svcpod", "-n", "default", "-o", "jsonpath={.spec.clusterIP}"]).stdout.strip()
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(SERVICE_CIDR)

    def answers() -> str | None:
        p = kube.lab.run("node-b", ["curl", "-s", "--max-time", "2", f"http://{ip}/healthz"], check=False)
        return p.stdout if p.returncode == 0 else None

    assert '"ok": true' in wait_for(answers, 60, "the Service's cluster IP to answer on node-b")
    # and on the other node: each node routes the others' podCIDRs to them
    p = kube.lab.run("node-a", ["curl", "-s", "--max-time", "5", f"http://{ip}/healthz"], check=False)
    assert '"ok": true' in p.stdout, p.stderr
    assert "table ip kube-proxy" in kube.lab.run("node-b", ["nft", "list", "tables"]).stdout
    assert Path("/proc/sys/net/netfilter/nf_conntrack_max").read_text() == conntrack_max
    kube.kubectl(["delete", "service", "svcpod", "-n", "default"])
    kube.kubectl(["delete", "pod", "svcpod", "-n", "default", "--wait=true"])


def test_a_podman_container_beside_a_pod_does_not_keep_the_pod_from_going(kube: KubeCluster) -> None:
    """Podman makes /run/netns a shared mount of itself on first use; over the node's containerd pod
    namespaces already mounted there, it hid them and containerd could not remove them: the pod hung
    in Terminating. The node holder makes that mount before containerd starts."""
    from podmigrate.workload import manage

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "beside", "namespace": "default"},
           "spec": {"nodeName": "node-a", "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "heap", "image": workload_image().replace(layout.REGISTRY, NODE_REGISTRY),
                                    "env": [{"name": "HEAP_MB", "value": "8"}]}]}}  # fmt: skip
    kube.kubectl(["apply", "-f", "-"], input=json.dumps(pod))
    kube.kubectl(["wait", "--for", "condition=Ready", "pod/beside", "-n", "default", "--timeout=120s"])
    manage.start(kube.lab, "besidepod", "node-a", 8)  # a Podman container, its netns under /run/netns too
    try:
        kube.kubectl(["delete", "pod", "beside", "-n", "default", "--wait=false"])

        def gone() -> bool:
            p = kube.kubectl(["get", "pod", "beside", "-n", "default"], check=False)
            return p.returncode != 0 and "NotFound" in p.stderr

        wait_for(gone, 60, "the pod beside a Podman container to be deleted")
    finally:
        manage.stop(kube.lab, "besidepod")
