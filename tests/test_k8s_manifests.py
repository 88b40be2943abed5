"""The Kubernetes manifests: generated parts up to date, every object valid for the API, the examples
valid for the CRD, and the permissions the code needs granted (offline: no cluster runs here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from podmigrate.k8s import crd, manifests

ROOT = Path(__file__).parents[1]
K8S = ROOT / "deploy/kubernetes"
KUBE_VERSION = "1.31.0"  # the study's CRI-O 1.31 cluster


@pytest.fixture(scope="module")
def tools() -> Path:
    bin_dir = Path(os.environ.get("PODMIGRATE_TOOLS", "/var/lib/podmigrate/tools")) / "bin"
    if not (bin_dir / "kustomize").exists():
        subprocess.run(["bash", str(ROOT / "scripts/k8s-tools")], check=True, capture_output=True)
    return bin_dir


def build(tools: Path, tree: str, with_kubectl: bool = False) -> list[dict[str, Any]]:
    cmd = [str(tools / "kubectl"), "kustomize"] if with_kubectl else [str(tools / "kustomize"), "build"]
    out = subprocess.run([*cmd, str(K8S / tree)], check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_the_crd_manifest_is_generated_from_the_code() -> None:
    assert (K8S / "base/crd.yaml").read_text() == manifests.crd_yaml(), (
        "run: podmigrate k8s crd > deploy/kubernetes/base/crd.yaml"
    )


@pytest.mark.parametrize("tree", ["base", "examples"])
def test_kustomize_and_kubectl_render_the_same_valid_objects(tools: Path, tree: str) -> None:
    docs = build(tools, tree)
    assert docs == build(tools, tree, with_kubectl=True)
    for doc in docs:
        if doc["kind"] == crd.KIND:
            continue  # a custom resource: checked against its own schema below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    kinds = sorted(d["kind"] for d in docs)
    if tree == "base":
        assert kinds == sorted(
            ["Namespace", "CustomResourceDefinition", "ServiceAccount", "ServiceAccount", "ClusterRole", "ClusterRole",
             "ClusterRoleBinding", "ClusterRoleBinding", "ConfigMap", "Deployment", "Service", "DaemonSet",
             "RuntimeClass"]
        )  # fmt: skip
        assert all(
            d["metadata"].get("namespace") == "podmigrate-system"
            for d in docs
            if d["kind"] in ("Deployment", "DaemonSet")
        )


def test_a_broken_manifest_is_caught(tools: Path) -> None:
    ds = next(d for d in build(tools, "base") if d["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["portz"] = [{"containerPort": 7070}]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSION, strict=True)


def schema() -> dict[str, Any]:
    s: dict[str, Any] = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return s


def test_the_example_migration_is_valid_for_the_crd(tools: Path) -> None:
    plm = next(d for d in build(tools, "examples") if d["kind"] == crd.KIND)
    jsonschema.validate(plm, schema())
    assert crd.validate_spec(plm["spec"])["mode"] == "decoupled"


@pytest.mark.parametrize(
    "spec, message",
    [
        ({}, "'podName' is a required property"),
        ({"podName": "web", "mode": "warp"}, "'warp' is not one of"),
        ({"podName": "Web_1"}, "does not match"),
        ({"podName": "web", "timeouts": {"restoreSeconds": 0}}, "less than the minimum of 1"),
        ({"podName": "web", "compression": "lz4"}, "'lz4' is not one of"),
        ({"podName": "web", "transport": "stream"}, "'stream' is not one of"),
    ],
)
def test_the_schema_rejects_bad_specs_as_the_api_server_would(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate({"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {}, "spec": spec}, schema())


def test_spec_rules_the_schema_cannot_express() -> None:
    with pytest.raises(crd.SpecError, match="not both"):
        crd.validate_spec({"podName": "web", "targetNode": "a", "targetNodeSelector": {"x": "y"}})
    with pytest.raises(crd.SpecError, match="listed twice"):
        crd.validate_spec({"podName": "web", "containers": ["a", "a"]})
    with pytest.raises(crd.SpecError, match="cold restart checkpoints nothing"):
        crd.validate_spec({"podName": "web", "mode": "cold", "containers": ["a"]})
    assert crd.validate_spec({"podName": "web"})["timeouts"] == {"checkpointSeconds": 120, "restoreSeconds": 300}


def test_printer_columns_point_at_fields_of_the_schema() -> None:
    props = schema()["properties"]
    for col in crd.PRINTER_COLUMNS:
        node: dict[str, Any] = {"properties": {**props, "metadata": {"properties": {"creationTimestamp": {}}}}}
        for part in col["jsonPath"].strip(".").split("."):
            assert part in node.get("properties", {}), col
            node = node["properties"][part]


def rules(docs: list[dict[str, Any]], role: str) -> set[tuple[str, str, str]]:
    r = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == role)
    return {
        (g, res, v)
        for rule in r["rules"]
        for g in rule["apiGroups"]
        for res in rule["resources"]
        for v in rule["verbs"]
    }


def test_rbac_grants_what_the_code_calls_and_the_agent_nothing_more(tools: Path) -> None:
    docs = build(tools, "base")
    op = rules(docs, "podmigrate-operator")
    for need in [
        ("podmigrate.io", "podlivemigrations/status", "patch"),
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods", "patch"),
        ("", "services", "patch"),
        ("", "nodes", "list"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("", "events", "create"),
    ]:
        assert need in op, need
    assert rules(docs, "podmigrate-agent") == {("", "nodes/checkpoint", "create")}


def test_the_agent_sees_the_kubelets_checkpoint_directory_where_it_looks(tools: Path) -> None:
    ds = next(d for d in build(tools, "base") if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    arg = next(a for a in c["command"] if a.startswith("--checkpoint-dir="))
    mount = next(m for m in c["volumeMounts"] if m["name"] == "checkpoints")
    host = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
    assert arg.split("=", 1)[1] == mount["mountPath"] and host["hostPath"]["path"] == "/var/lib/kubelet/checkpoints"
    assert {e["name"] for e in c["env"]} >= {"NODE_NAME", "HOST_IP", "PODMIGRATE_AGENT_TOKEN"}
    assert any(p["name"] == "agent" and p["containerPort"] == 7070 for p in c["ports"])
