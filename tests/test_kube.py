"""Upstream Kubernetes in the lab (real lab, real binaries of the pinned release): the control plane
comes up on the lab's LAN, reports the pinned version, refuses what its authorizers refuse, and takes
podmigrate's manifests as a real API server does (CRD schema checked, status not pruned, RBAC as
written). The first run on a machine builds the binaries (``kube.build``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podmigrate.k8s import manifests
from podmigrate.k8s.crd import STATUS_SCHEMA
from podmigrate.kube import build
from podmigrate.kube.cluster import CONTROL_PLANE, KubeCluster
from podmigrate.lab.cluster import Lab

pytestmark = pytest.mark.lab
DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def kube(containerd_lab: Lab) -> Iterator[KubeCluster]:
    cluster = KubeCluster(containerd_lab)
    cluster.up(lambda m: print(f"[kube] {m}", flush=True))
    yield cluster
    cluster.down()


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
    assert st["components"] == {name: True for name in CONTROL_PLANE}
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
