"""The Kubernetes manifests: generated parts up to date, every object valid for the API, the examples
valid for the CRD, and the permissions the code needs granted (offline: no cluster runs here)."""

from __future__ import annotations

import copy
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


@pytest.mark.parametrize("tree", ["base", "examples", "lab"])
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
            ["Namespace", "CustomResourceDefinition", "CustomResourceDefinition", "ServiceAccount", "ServiceAccount",
             "ClusterRole", "ClusterRole",
             "ClusterRoleBinding", "ClusterRoleBinding", "ConfigMap", "Deployment", "Service", "DaemonSet",
             "RuntimeClass", "NetworkPolicy", "Service", "ValidatingWebhookConfiguration"]
        )  # fmt: skip
        assert all(
            d["metadata"].get("namespace") == "podmigrate-system"
            for d in docs
            if d["kind"] in ("Deployment", "DaemonSet", "NetworkPolicy")
        )


def test_the_labs_overlay_changes_only_what_the_lab_needs(tools: Path) -> None:
    base, lab = build(tools, "base"), build(tools, "lab")
    assert [(d["kind"], d["metadata"]["name"]) for d in base] == [(d["kind"], d["metadata"]["name"]) for d in lab]
    by = {(d["kind"], d["metadata"]["name"]): d for d in lab}
    agent = by[("DaemonSet", "podmigrate-agent")]["spec"]["template"]["spec"]
    assert agent["hostNetwork"] and "--listen=0.0.0.0:7072" in agent["containers"][0]["command"]
    assert {p["name"]: p["containerPort"] for p in agent["containers"][0]["ports"]} == {"agent": 7072, "health": 7073}
    assert by[("Deployment", "podmigrate-operator")]["spec"]["template"]["spec"]["hostNetwork"]
    assert by[("ConfigMap", "podmigrate-config")]["data"]["PODMIGRATE_REGISTRY"] == "localhost:5000/checkpoints"


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
        ({"podName": "web", "transport": "lazy"}, "'lazy' is not one of"),
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
    with pytest.raises(crd.SpecError, match="restored by the podmigrate RuntimeClass, not by CRI"):
        crd.validate_spec({"podName": "web", "transport": "stream", "restorePath": "cri"})
    assert crd.validate_spec({"podName": "web", "transport": "stream"})["restorePath"] == "auto"
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
        ("", "nodes", "watch"),  # the taints that start evacuations
        ("", "nodes", "patch"),  # cordon
        ("podmigrate.io", "nodeevacuations", "create"),
        ("podmigrate.io", "nodeevacuations/status", "patch"),
        ("podmigrate.io", "podlivemigrations", "create"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "create"),  # a streamed migration's handover slices
        ("discovery.k8s.io", "endpointslices", "patch"),
        ("discovery.k8s.io", "endpointslices", "delete"),
        ("", "events", "create"),
    ]:
        assert need in op, need
    assert rules(docs, "podmigrate-agent") == {("", "nodes/checkpoint", "create")}
    # nothing beyond what the code and kopf call: kopf patches (never updates), nothing watches pods
    assert not {r for r in op if r[2] in ("update", "*", "escalate", "bind", "impersonate")}, op
    assert ("", "pods", "watch") not in op and ("", "secrets", "get") not in op
    assert {r for r in op if r[1] == "podlivemigrations/status"} == {
        ("podmigrate.io", "podlivemigrations/status", "patch")
    }


def test_the_agent_sees_the_kubelets_checkpoint_directory_where_it_looks(tools: Path) -> None:
    ds = next(d for d in build(tools, "base") if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    arg = next(a for a in c["command"] if a.startswith("--checkpoint-dir="))
    mount = next(m for m in c["volumeMounts"] if m["name"] == "checkpoints")
    host = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
    assert arg.split("=", 1)[1] == mount["mountPath"] and host["hostPath"]["path"] == "/var/lib/kubelet/checkpoints"
    assert {e["name"] for e in c["env"]} >= {"NODE_NAME", "HOST_IP"}
    assert any(p["name"] == "agent" and p["containerPort"] == 7070 for p in c["ports"])


def flags(command: list[str]) -> dict[str, str]:
    return {a.partition("=")[0]: a.partition("=")[2] for a in command if a.startswith("--")}


def workload(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = next(d for d in docs if d["kind"] == kind)["spec"]["template"]["spec"]
    return spec


def mounted(pod: dict[str, Any], path: str) -> str:
    """The Secret mounted at the directory of ``path`` in the pod's first container."""
    c = pod["containers"][0]
    m = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    return str(next(v for v in pod["volumes"] if v["name"] == m["name"])["secret"]["secretName"])


def test_the_agent_serves_mutual_tls_and_verifies_the_kubelet(tools: Path) -> None:
    docs = build(tools, "base")
    pod = workload(docs, "DaemonSet")
    c = pod["containers"][0]
    f = flags(c["command"])
    assert "--kubelet-insecure-tls" not in f and f["--kubelet-ca"].endswith("ca.crt")
    assert f["--kubelet-ca"].startswith("/var/run/secrets/kubernetes.io/serviceaccount/")  # the cluster CA
    assert f["--listen"].endswith(":7070") and f["--client-names"] == "podmigrate-operator"
    secret = {mounted(pod, f[x]) for x in ("--tls-cert", "--tls-key", "--client-ca")}
    assert secret == {"podmigrate-agent-tls"}
    assert "PODMIGRATE_AGENT_TOKEN" not in {e["name"] for e in c["env"]}  # the certificate is the identity
    # the probes carry no client certificate: they go to the plain /healthz port, not the API's
    health = f["--health-listen"].rsplit(":", 1)[1]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == int(health) != ports["agent"]
    assert c["livenessProbe"]["httpGet"]["port"] == c["readinessProbe"]["httpGet"]["port"] == "health"
    # and the operator calls them with its certificate, against the same CA
    op = workload(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in op["containers"][0]["env"]}
    assert "PODMIGRATE_AGENT_TOKEN" not in env
    assert {mounted(op, env[x]) for x in ("PODMIGRATE_AGENT_CA", "PODMIGRATE_AGENT_CERT", "PODMIGRATE_AGENT_KEY")} == {
        "podmigrate-operator-tls"
    }


def test_only_the_operator_reaches_the_agents_port(tools: Path) -> None:
    docs = build(tools, "base")
    np = next(d for d in docs if d["kind"] == "NetworkPolicy")["spec"]
    assert np["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "podmigrate-agent"}
    assert np["policyTypes"] == ["Ingress"]
    to_agent = [r for r in np["ingress"] if any(p["port"] == 7070 for p in r.get("ports", []))]
    assert len(to_agent) == 1 and to_agent[0]["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "podmigrate-operator"}}}
    ]
    # whatever else is let in, it is not the agents' API port
    assert all(
        r.get("ports") and all(p["port"] != 7070 for p in r["ports"]) for r in np["ingress"] if r not in to_agent
    )
    # the operator's pods carry the label the policy lets in
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "podmigrate-operator"


def test_the_config_has_the_allow_lists_and_cert_manager_makes_the_secrets_mounted(tools: Path) -> None:
    cfg = next(d for d in build(tools, "base") if d["kind"] == "ConfigMap")["data"]
    assert {"PODMIGRATE_ALLOWED_REGISTRIES", "PODMIGRATE_NAMESPACES", "PODMIGRATE_REGISTRY"} <= set(cfg)
    certs = build(tools, "cert-manager")
    made = {d["spec"]["secretName"]: d["spec"] for d in certs if d["kind"] == "Certificate"}
    assert {"podmigrate-agent-tls", "podmigrate-operator-tls"} <= set(made)
    assert made["podmigrate-operator-tls"]["commonName"] == "podmigrate-operator"  # the agents' --client-names
    assert all(d["metadata"]["namespace"] == "podmigrate-system" for d in certs)


def test_the_single_container_example_is_the_server_where_its_sidecar_was() -> None:
    """``bench k8s --pod single``: one container, as the lab engine moves, behind the same Service."""
    from podmigrate.kube.install import single_container

    docs = [d for d in yaml.safe_load_all((K8S / "examples/heapsrv.yaml").read_text()) if d]
    pod, service = (next(d for d in docs if d["kind"] == kind) for kind in ("Pod", "Service"))
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "sidecar")
    single = single_container(copy.deepcopy(docs))
    (server,) = next(d for d in single if d["kind"] == "Pod")["spec"]["containers"]
    assert server["name"] == "server" and server["ports"] == sidecar["ports"]
    assert server["readinessProbe"] == sidecar["readinessProbe"]
    assert {"name": "LISTEN", "value": "0.0.0.0:8000"} in server["env"]
    assert next(d for d in single if d["kind"] == "Service") == service  # the Service sends where it did
    kubernetes_validate.validate(next(d for d in single if d["kind"] == "Pod"), KUBE_VERSION, strict=True)
