"""podmigrate on upstream Kubernetes in the lab (``conftest.kube``), installed as users install it:
its image built from ``deploy/Containerfile``, ``kubectl apply -k``, the operator and the agents as
pods, the user's example and PodLiveMigration files. The migrations are checked by what the workload
says (heap SHA-256, process start, counter), what the API holds (pods, Services' endpoints, the
status the operator wrote) and what is left on the nodes; then what only a real cluster does: the
operator's pod deleted and the API server restarted mid-migration, ``kubectl drain`` with a
PodDisruptionBudget through the eviction webhook."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from podmigrate import procs
from podmigrate.k8s.crd import STATUS_SCHEMA
from podmigrate.kube import image, install
from podmigrate.kube.cluster import KubeCluster

from .conftest import wait_for
from .kube_helpers import NS, final, get, kept, leftovers, migrate, nodes_settled, phase_of, plm, serving

pytestmark = pytest.mark.lab


@pytest.fixture
def cluster(installed: KubeCluster) -> KubeCluster:
    return installed


def test_the_operator_and_agents_run_as_pods_installed_with_kubectl_apply_k(cluster: KubeCluster) -> None:
    pods = get(cluster, "pods", "-n", install.NS)["items"]
    by_app: dict[str, list[dict[str, Any]]] = {}
    for p in pods:
        by_app.setdefault(p["metadata"]["labels"]["app.kubernetes.io/name"], []).append(p)
    assert sorted(p["spec"]["nodeName"] for p in by_app["podmigrate-agent"]) == cluster.lab.nodes
    assert len(by_app["podmigrate-operator"]) == 1
    ref = image.node_reference(image.project_image())  # the image built from this checkout's Containerfile
    for p in pods:
        assert p["status"]["phase"] == "Running"
        assert [c["image"] for c in p["spec"]["containers"]] == [ref]
        assert p["spec"]["serviceAccountName"] in ("podmigrate-agent", "podmigrate-operator")
    # the webhook's CA was set by the operator from its own Secret
    hook = get(cluster, "validatingwebhookconfiguration", "podmigrate-eviction")
    assert hook["webhooks"][0]["clientConfig"].get("caBundle")


def _mid_migration(
    cluster: KubeCluster, disturb: Callable[[str], None], when: tuple[str, ...] = ("Checkpointing", "Transferring"),
    body: dict[str, Any] | None = None, outcomes: tuple[str, ...] = ("Completed", "RolledBack"),
) -> dict[str, Any]:  # fmt: skip
    """A migration disturbed (``disturb(source node)``) once in a phase of ``when``: it ends in one of
    ``outcomes``, and either way one pod serves with the heap and process it had, and nothing is left."""
    pod, before = serving(cluster)
    name = migrate(cluster, body)
    wait_for(lambda: phase_of(cluster, name) in when, 120, f"the migration in {when}", 0.05)
    disturb(pod["spec"]["nodeName"])
    st = final(cluster, name, 600)
    assert st["phase"] in outcomes, st.get("message")
    _pod, after = serving(cluster)
    kept(before, after)
    wait_for(lambda: leftovers(cluster) == {n: [] for n in cluster.lab.nodes}, 60, "no checkpoint archive left")
    return st


def test_an_agent_without_nodes_checkpoint_is_refused_by_the_real_authorizer(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    """The agents run as a ServiceAccount no role is bound to: the kubelet's SubjectAccessReview for
    ``nodes/checkpoint`` is refused by the real API server (a new user: nothing cached)."""
    source_pod, before = serving(cluster)
    ns = install.NS
    cluster.kubectl(["-n", ns, "create", "serviceaccount", "podmigrate-agent-restricted"], check=False)
    patch = {"spec": {"template": {"spec": {"serviceAccountName": "podmigrate-agent-restricted"}}}}
    cluster.kubectl(["-n", ns, "patch", "daemonset", "podmigrate-agent", "-p", json.dumps(patch)])
    try:
        cluster.kubectl(["-n", ns, "rollout", "status", "daemonset/podmigrate-agent", "--timeout=180s"], timeout=200)
        st = final(cluster, migrate(cluster))
    finally:
        cluster.kubectl(["apply", "-k", str(cluster.paths.host / "install")])
        cluster.kubectl(["-n", ns, "rollout", "status", "daemonset/podmigrate-agent", "--timeout=180s"], timeout=200)
        cluster.kubectl(["-n", ns, "delete", "serviceaccount", "podmigrate-agent-restricted"], check=False)
    assert st["phase"] in ("Failed", "RolledBack")
    assert st["record"]["phase"] == "checkpoint"
    assert "Forbidden" in st["message"] and "podmigrate-agent-restricted" in st["message"], st["message"]
    pod, after = serving(cluster)
    assert pod["metadata"]["name"] == source_pod["metadata"]["name"]
    kept(before, after)


def test_the_example_moves_with_its_heap_through_the_runtimes_restore(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    (source_pod, before) = serving(cluster)
    source = source_pod["spec"]["nodeName"]
    st = final(cluster, migrate(cluster))
    assert st["phase"] == "Completed", st.get("message")
    assert st["restorePath"] == "cri" and st["sourceNode"] == source
    pod, after = serving(cluster)
    assert pod["metadata"]["name"] == st["restoredPod"]["name"] != source_pod["metadata"]["name"]
    assert pod["spec"]["nodeName"] == st["targetNode"] != source
    kept(before, after)

    # the Service selects the copy alone, and its cluster IP answers on the node the pod left
    def endpoints() -> list[str]:
        slices = get(cluster, "endpointslices", "-n", NS, "-l", "kubernetes.io/service-name=heapsrv")["items"]
        return [a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]]

    wait_for(lambda: endpoints() == [pod["status"]["podIP"]], 30, "the Service's endpoints to be the copy alone")
    ip = get(cluster, "service", "heapsrv", "-n", NS)["spec"]["clusterIP"]

    def through_cluster_ip() -> dict[str, Any] | None:
        # the endpoints are the copy's; the source's kube-proxy programs them a moment later
        p = cluster.lab.run(source, ["curl", "-s", "--max-time", "5", f"http://{ip}/state"], check=False)
        return dict(json.loads(p.stdout)) if p.returncode == 0 and p.stdout.startswith("{") else None

    assert wait_for(through_cluster_ip, 30, "the cluster IP to answer on the source")["sha256"] == before["sha256"]
    # every status field the operator wrote was kept by the API server (the CRD's schema declares it)
    assert set(st) <= set(STATUS_SCHEMA["properties"]) and {"phaseTimings", "checkpointImages", "record"} <= set(st)
    assert leftovers(cluster) == {n: [] for n in cluster.lab.nodes}


def test_stop_copy_through_the_runtimeclass(cluster: KubeCluster, example: dict[str, Any]) -> None:
    source_pod, before = serving(cluster)
    spec = {"podName": source_pod["metadata"]["name"], "mode": "stop-copy", "restorePath": "runtimeclass",
            "service": "heapsrv"}  # fmt: skip
    name = migrate(cluster, {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration",
                             "metadata": {"name": "heapsrv-rc"}, "spec": spec})  # fmt: skip
    st = final(cluster, name)
    assert st["phase"] == "Completed", st.get("message")
    assert st["restorePath"] == "runtimeclass" and st["blackoutSeconds"] > 0
    pod, after = serving(cluster)
    assert pod["spec"]["runtimeClassName"] == "podmigrate"
    kept(before, after)
    assert leftovers(cluster) == {n: [] for n in cluster.lab.nodes}


def test_the_operators_pod_deleted_mid_migration(cluster: KubeCluster, example: dict[str, Any]) -> None:
    def delete_operator(_source: str) -> None:
        cluster.kubectl(["delete", "pod", "-n", install.NS, "-l", "app.kubernetes.io/name=podmigrate-operator",
                         "--wait=false"])  # fmt: skip

    _mid_migration(cluster, delete_operator)
    cluster.kubectl(["rollout", "status", "-n", install.NS, "deployment/podmigrate-operator", "--timeout=120s"])


def test_the_api_server_restarted_mid_migration(cluster: KubeCluster, example: dict[str, Any]) -> None:
    _mid_migration(cluster, lambda _source: restart(cluster, "kube-apiserver"))


def restart(cluster: KubeCluster, component: str) -> None:
    p = cluster.running(component)
    assert p is not None
    procs.stop(p, cluster.lab.cgroup_path)
    cluster.up()  # starts what is not running, and waits for it


def test_etcd_restarted_mid_migration(cluster: KubeCluster, example: dict[str, Any]) -> None:
    _mid_migration(cluster, lambda _source: restart(cluster, "etcd"))


def test_the_source_kubelet_restarted_while_it_checkpoints(cluster: KubeCluster, example: dict[str, Any]) -> None:
    _mid_migration(cluster, lambda source: restart(cluster, f"kubelet-{source}"), when=("Checkpointing",))


def test_the_registry_down_before_the_push_rolls_back(cluster: KubeCluster, example: dict[str, Any]) -> None:
    hold = cluster.lab.dir / "hold" / "registry"

    def registry_down(_source: str) -> None:
        hold.touch()  # the lab's supervisor leaves it down
        cluster.lab.kill_service("registry", signal.SIGKILL)

    try:
        st = _mid_migration(cluster, registry_down, ("Checkpointing",), outcomes=("RolledBack",))
    finally:
        hold.unlink(missing_ok=True)
    assert st["record"]["phase"] in ("checkpoint", "package"), st["record"]
    wait_for(lambda: cluster.lab.service("registry"), 60, "the registry back")


def test_the_targets_containerd_killed_while_it_restores_rolls_back(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    holds: list[Path] = []

    def kill_target(source: str) -> None:
        target = next(n for n in cluster.lab.nodes if n != source)
        holds.append(cluster.lab.dir / "hold" / f"containerd-{target}")
        holds[-1].touch()
        cluster.lab.kill_service(f"containerd-{target}", signal.SIGKILL)

    body = plm("heapsrv-hold", {"mode": "decoupled", "timeouts": {"restoreSeconds": 20}})
    try:
        st = _mid_migration(cluster, kill_target, ("Restoring",), body, outcomes=("RolledBack",))
    finally:
        for h in holds:
            h.unlink(missing_ok=True)
    assert st["record"]["phase"] == "restore", st["record"]
    node = holds[0].name.removeprefix("containerd-")
    wait_for(lambda: cluster.node_ready(node), 180, f"{node} Ready again")
    wait_for(lambda: nodes_settled(cluster), 180, f"{node} untainted again")


def test_kubectl_drain_moves_the_opted_in_pod_and_respects_its_budget(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    source_pod, before = serving(cluster)
    source = source_pod["spec"]["nodeName"]
    pdb = get(cluster, "pdb", "heapsrv", "-n", NS)
    assert pdb["status"]["disruptionsAllowed"] == 0  # a plain eviction would be refused
    # --force: the example is a bare pod (kubectl drain refuses those without it, whatever the webhook)
    p = cluster.kubectl(["drain", source, "--ignore-daemonsets", "--force", "--timeout=300s"], check=False,
                        timeout=330)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "podmigrate is moving" in p.stderr  # held by the webhook (429) while it moved
    pod, after = serving(cluster)
    assert pod["spec"]["nodeName"] != source
    kept(before, after)
    plms = [m for m in get(cluster, "plm", "-n", NS)["items"] if m["spec"]["podName"] == source_pod["metadata"]["name"]]
    assert [m["status"]["phase"] for m in plms].count("Completed") == 1
    assert len(plms) <= 2  # the drain's and the cordon's evacuation wait on one migration, not race
    evacuations = [e for e in get(cluster, "nev")["items"] if e["spec"]["nodeName"] == source]
    assert len(evacuations) == 1  # one per cordon, however many events the cordon made
    cluster.kubectl(["uncordon", source])
