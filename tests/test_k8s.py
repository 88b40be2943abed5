"""The operator, node agents and controller against an emulated cluster (see ``k8s_sim``).

Real: kopf and the operator process, the node agents' HTTP servers, their kubelet client over TLS, the
checkpoint-image push to a real registry and the digest-verified pull. Emulated: the Kubernetes API
(kmock), the kubelet's checkpoint endpoint and the kubelets' pod lifecycle.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from podmigrate.k8s import agent as node_agent
from podmigrate.k8s import api as k
from podmigrate.k8s.kubelet import KubeletClient
from tests.conftest import wait_for
from tests.k8s_sim import (
    KMock,
    KubeletCheckpointEmulator,
    NodeSim,
    Operator,
    Registry,
    free_port,
    self_signed_cert,
)

NS = "default"
NODES = ("node-a", "node-b")
AGENT_TOKEN = secrets.token_hex(16)
KUBELET_TOKEN = secrets.token_hex(16)
PLMS = "/apis/podmigrate.io/v1alpha1/namespaces/default/podlivemigrations"


class Cluster:
    def __init__(self, tmp: Path, reg: Registry, kubelets: dict[str, KubeletCheckpointEmulator], ports: dict[str, int]):
        self.tmp, self.registry, self.kubelets, self.agent_ports = tmp, reg, kubelets, ports
        self.kmock = KMock().start()
        self.api = self.kmock.api()
        self.metrics_port = free_port()
        for node in (*NODES, "node-c"):
            ready = "True" if node != "node-c" else "False"
            self.api.create(
                k.nodes(), {"metadata": {"name": node}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}
            )
        for node in NODES:
            self.add_agent_pod(node)
        self.sim = NodeSim(self.api, reg.host, kubelets)
        self.operator = Operator(
            {
                "PODMIGRATE_KUBE_SERVER": self.kmock.url,
                "PODMIGRATE_AGENT_TOKEN": AGENT_TOKEN,
                "PODMIGRATE_REGISTRY": f"{reg.host}/checkpoints",
                "PODMIGRATE_METRICS_PORT": str(self.metrics_port),
                "PODMIGRATE_POLL_S": "0.05",
            },
            tmp / "operator.log",
        ).start()

    def add_agent_pod(self, node: str) -> None:
        self.api.create(
            k.pods("podmigrate-system"),
            {
                "metadata": {
                    "name": f"podmigrate-agent-{node}",
                    "namespace": "podmigrate-system",
                    "labels": {"app.kubernetes.io/name": "podmigrate-agent"},
                },
                "spec": {
                    "nodeName": node,
                    "containers": [
                        {"name": "agent", "ports": [{"name": "agent", "containerPort": self.agent_ports[node]}]}
                    ],
                },
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
        )

    def start_workload(self, name: str = "heapsrv", node: str = "node-a") -> dict[str, str]:
        self.api.create(
            k.pods(NS),
            {
                "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
                "spec": {
                    "nodeName": node,
                    "containers": [
                        {"name": "server", "image": "localhost/heapsrv:1"},
                        {"name": "sidecar", "image": "localhost/sidecar:1"},
                    ],
                },
            },
        )
        self.api.create(
            k.services(NS),
            {
                "metadata": {"name": "web", "namespace": NS},
                "spec": {"selector": {"app": name}, "ports": [{"port": 80}]},
            },
        )
        wait_for(lambda: k.pod_ready(self.api.get(k.pods(NS, name)) or {}), 60, f"{name} ready")
        return self.heap_digests(node, name)

    def heap_digests(self, node: str, pod: str) -> dict[str, str]:
        heaps = self.kubelets[node].heaps
        return {c: hashlib.sha256(heaps[(NS, pod, c)]).hexdigest() for c in ("server", "sidecar")}

    def migrate(self, name: str, spec: dict[str, Any]) -> None:
        meta = {"name": name, "namespace": NS, "resourceVersion": "1"}
        self.api.create(
            PLMS, {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration", "metadata": meta, "spec": spec}
        )

    def status(self, name: str) -> dict[str, Any]:
        return (self.api.get(f"{PLMS}/{name}") or {}).get("status") or {}

    def wait_phase(self, name: str, *phases: str, timeout: float = 60) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            st = self.status(name)
            return st if st.get("phase") in phases else None

        try:
            result: dict[str, Any] = wait_for(done, timeout, f"{name} to reach {phases}", step=0.05)
        except AssertionError:
            raise AssertionError(
                f"{self.status(name)}\n--- node errors: {self.sim.errors[-5:]}\n--- operator log:\n{self.log()[-4000:]}"
            ) from None
        return result

    def events(self) -> list[tuple[str, str]]:
        return [(e.get("reason", ""), e.get("message", "")) for e in self.api.list("/api/v1/namespaces/default/events")]

    def log(self) -> str:
        return (self.tmp / "operator.log").read_text(errors="replace")

    def archives(self, node: str) -> list[Path]:
        return sorted(self.kubelets[node].dir.glob("*.tar"))

    def close(self) -> None:
        self.operator.stop()
        self.sim.close()
        self.api.close()
        self.kmock.stop()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, dict[str, Any], dict[str, int]]]:
    """A real registry, and per node a kubelet checkpoint endpoint and a real node agent."""
    tmp = tmp_path_factory.mktemp("k8s")
    reg = Registry(tmp / "registry")
    cert, key = self_signed_cert(tmp)
    kubelets, servers, ports = {}, [], {}
    for node in NODES:
        kubelets[node] = KubeletCheckpointEmulator(node, tmp / node / "checkpoints", KUBELET_TOKEN, cert, key)
        client = KubeletClient(kubelets[node].url, KUBELET_TOKEN, ca=str(cert))
        app = node_agent.build_app(node, AGENT_TOKEN, client, kubelets[node].dir)
        server = node_agent.serve(app, "127.0.0.1:0")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        ports[node] = server.server_address[1]
    yield reg, kubelets, ports
    for s in servers:
        s.shutdown()
    for kl in kubelets.values():
        kl.close()
    reg.close()


@pytest.fixture
def cluster(nodes: tuple[Registry, dict[str, Any], dict[str, int]], tmp_path: Path) -> Iterator[Cluster]:
    reg, kubelets, ports = nodes
    for kl in kubelets.values():
        kl.heaps.clear()
        kl.calls.clear()
        kl.fail_with = None
        kl.hold.set()
        kl.on_call = None
        for a in kl.dir.glob("*.tar"):
            a.unlink()
    c = Cluster(tmp_path, reg, kubelets, ports)
    yield c
    c.close()


def assert_rolled_back(c: Cluster, name: str, source_digests: dict[str, str]) -> dict[str, Any]:
    st = c.wait_phase(name, "RolledBack", "Failed")
    assert st["phase"] == "RolledBack", st
    pod = c.api.get(k.pods(NS, "heapsrv"))
    assert pod is not None and pod["spec"]["nodeName"] == "node-a" and k.pod_ready(pod)
    assert "podmigrate.io/migration" not in (pod["metadata"].get("annotations") or {})
    assert c.heap_digests("node-a", "heapsrv") == source_digests  # the source was never touched
    svc = c.api.get(k.services(NS, "web"))
    assert svc is None or k.selects(svc["spec"]["selector"], pod["metadata"]["labels"]), svc
    rec = st["record"]
    assert c.api.get(k.pods(NS, rec["restored"])) is None
    assert not [r for r in rec.get("references", {}).values() if c.registry.has(r)]
    assert c.archives("node-a") == []
    assert any(r == "RolledBack" for r, _ in c.events())
    return st


# ------------------------------------------------------------------------------------------ tests
def test_decoupled_migration_moves_the_pod_with_its_memory_there_and_back(cluster: Cluster) -> None:
    c = cluster
    before = c.start_workload()
    c.migrate("move-1", {"podName": "heapsrv", "targetNode": "node-b"})
    st = c.wait_phase("move-1", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    restored = st["restoredPod"]["name"]
    assert st["restoredPod"]["node"] == "node-b" and restored.startswith("heapsrv-m")
    # both containers were checkpointed through the kubelet of the source node, nothing else
    assert sorted(c.kubelets["node-a"].calls) == [(NS, "heapsrv", "server"), (NS, "heapsrv", "sidecar")]
    assert c.kubelets["node-b"].calls == []
    # the restored pod runs the checkpoint images, and their memory is the source's, bit for bit
    pod = c.api.get(k.pods(NS, restored))
    assert pod is not None and pod["spec"]["nodeName"] == "node-b"
    images = {x["name"]: x["image"] for x in pod["spec"]["containers"]}
    assert images == st["checkpointImages"] and all(
        i.startswith(c.registry.host + "/checkpoints/") for i in images.values()
    )
    assert {ctr: c.sim.restored[(restored, ctr)] for ctr in before} == before
    # the Service selects exactly the restored pod; the source is gone; no archive or tag is left
    sel = c.api.get(k.services(NS, "web"))["spec"]["selector"]  # type: ignore[index]
    assert sel == {"app": "heapsrv"}  # unpinned again: with the source gone it selects the copy alone
    assert c.api.get(k.pods(NS, "heapsrv")) is None
    assert c.archives("node-a") == [] and not any(c.registry.has(i) for i in images.values())
    assert set(st["phaseTimings"]) == {"validate", "checkpoint", "package", "restore", "cutover", "cleanup"}
    assert {c["type"]: c["status"] for c in st["conditions"]} == {"Progressing": "False", "Succeeded": "True"}
    assert st["bytes"] > 2 << 20 and st["blackoutSeconds"] == 0 and st["driftSeconds"] > 0
    reasons = [r for r, _ in c.events()]
    for r in ("Validate", "Checkpoint", "Package", "Restore", "Cutover", "Cleanup", "Completed"):
        assert r in reasons, reasons
    # and back: the copy on node-b is checkpointed by node-b's kubelet; the name does not grow
    c.migrate("move-2", {"podName": restored, "targetNode": "node-a"})
    st2 = c.wait_phase("move-2", "Completed", "Failed", "RolledBack")
    assert st2["phase"] == "Completed", st2
    back = st2["restoredPod"]["name"]
    assert back.startswith("heapsrv-m") and len(back) == len(restored) and st2["restoredPod"]["node"] == "node-a"
    assert {ctr: c.sim.restored[(back, ctr)] for ctr in before} == before
    metrics = httpx.get(f"http://127.0.0.1:{c.metrics_port}/metrics").text
    assert 'podmigrate_migrations_total{mode="decoupled",result="completed"} 2.0' in metrics
    assert 'podmigrate_phase_duration_seconds_count{mode="decoupled",phase="checkpoint"} 2.0' in metrics


def test_stop_copy_takes_the_source_out_of_service_before_its_checkpoint(cluster: Cluster) -> None:
    c = cluster
    before = c.start_workload()
    seen: list[dict[str, str]] = []
    c.kubelets["node-a"].on_call = lambda: seen.append(c.api.get(k.services(NS, "web"))["spec"]["selector"])  # type: ignore[index]
    c.migrate("sc", {"podName": "heapsrv", "targetNode": "node-b", "mode": "stop-copy"})
    st = c.wait_phase("sc", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    # at each checkpoint the Service selected no pod: nothing could change the state after it
    assert len(seen) == 2 and all(s["podmigrate.io/instance"].startswith("isolated-") for s in seen)
    assert st["driftSeconds"] == 0 and st["blackoutSeconds"] > 0
    assert {ctr: c.sim.restored[(st["restoredPod"]["name"], ctr)] for ctr in before} == before
    assert set(st["phaseTimings"]) >= {"isolate", "checkpoint"}


def test_cold_restart_starts_fresh_pods_and_checkpoints_nothing(cluster: Cluster) -> None:
    c = cluster
    before = c.start_workload()
    c.migrate("cold", {"podName": "heapsrv", "targetNode": "node-b", "mode": "cold"})
    st = c.wait_phase("cold", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    assert c.kubelets["node-a"].calls == [] and st["checkpointImages"] == {}
    pod = c.api.get(k.pods(NS, st["restoredPod"]["name"]))
    assert pod is not None
    assert [x["image"] for x in pod["spec"]["containers"]] == ["localhost/heapsrv:1", "localhost/sidecar:1"]
    assert c.heap_digests("node-b", st["restoredPod"]["name"]) != before  # new memory: the state is lost


@pytest.mark.parametrize(
    "fault", ["kubelet-fails", "no-agent", "registry-down", "restore-fails", "target-lost", "service-deleted"]
)
def test_a_failure_at_each_step_rolls_back_and_keeps_the_source(cluster: Cluster, fault: str) -> None:
    c = cluster
    before = c.start_workload()
    spec: dict[str, Any] = {"podName": "heapsrv", "targetNode": "node-b", "timeouts": {"restoreSeconds": 10}}
    if fault == "kubelet-fails":
        c.kubelets["node-a"].fail_with = 500
    elif fault == "no-agent":
        c.api.delete(k.pods("podmigrate-system", "podmigrate-agent-node-a"))
    elif fault == "registry-down":
        spec["registry"] = f"127.0.0.1:{free_port()}/checkpoints"
    elif fault == "restore-fails":
        c.sim.fail_restore = "CreateContainerError"
    elif fault == "target-lost":
        c.sim.lose_restored = True
    elif fault == "service-deleted":  # someone deletes the Service as the copy comes up
        c.sim.on_ready = lambda pod: pod["metadata"]["name"] != "heapsrv" and c.api.delete(k.services(NS, "web"))
    c.migrate("doomed", spec)
    st = assert_rolled_back(c, "doomed", before)
    failed_in = {
        "kubelet-fails": {"checkpoint"},
        "no-agent": {"checkpoint"},
        "registry-down": {"package"},
        "restore-fails": {"restore"},
        "target-lost": {"restore"},
        "service-deleted": {"cutover"},
    }[fault]
    assert st["record"]["phase"] in failed_in, st["record"]
    if fault == "kubelet-fails":
        assert "criu dump failed" in st["message"] and "CRIU" in st["record"]["error"]["hint"]
    if fault == "no-agent":
        assert "no ready podmigrate agent on node 'node-a'" in st["message"]
    if fault == "restore-fails":
        assert "CreateContainerError" in st["message"]
    if fault == "target-lost":
        assert "vanished" in st["message"]
    if fault == "no-agent":  # its undo could not reach the agent either: a leftover, said so
        assert "could not delete" in st["message"]


def test_invalid_specs_fail_with_a_message_that_names_the_field(cluster: Cluster) -> None:
    c = cluster
    c.start_workload()
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "no-pod": ({"podName": "nope", "targetNode": "node-b"}, "spec.podName: there is no pod 'nope'"),
        "same-node": ({"podName": "heapsrv", "targetNode": "node-a"}, "already runs on 'node-a'"),
        "bad-mode": ({"podName": "heapsrv", "mode": "warp"}, "spec.mode: 'warp' is not one of"),
        "not-ready": ({"podName": "heapsrv", "targetNode": "node-c"}, "node 'node-c' is not Ready"),
        "no-such-container": ({"podName": "heapsrv", "containers": ["db"]}, "has no container db"),
        "tainted": ({"podName": "heapsrv", "targetNode": "node-d"}, "does not tolerate its taint gpu:NoSchedule"),
    }
    taints = [{"key": "gpu", "effect": "NoSchedule"}]
    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    c.api.create(k.nodes(), {"metadata": {"name": "node-d"}, "spec": {"taints": taints}, "status": ready})
    for name, (spec, _) in cases.items():
        c.migrate(name, spec)
    for name, (_, message) in cases.items():
        st = c.wait_phase(name, "Failed", "Completed", "RolledBack")
        assert st["phase"] == "Failed" and st["reason"] == "InvalidSpec", (name, st)
        assert message in st["message"], (name, st["message"])
    assert c.kubelets["node-a"].calls == []  # nothing was started
    assert "podmigrate.io/migration" not in (c.api.get(k.pods(NS, "heapsrv")) or {})["metadata"].get("annotations", {})


def test_one_migration_per_pod_at_a_time(cluster: Cluster) -> None:
    c = cluster
    before = c.start_workload()
    c.kubelets["node-a"].hold.clear()
    c.migrate("first", {"podName": "heapsrv"})  # no target given: any other Ready node (node-b)
    wait_for(lambda: c.kubelets["node-a"].waiting, 60, "the first checkpoint to start", step=0.05)
    c.migrate("second", {"podName": "heapsrv", "targetNode": "node-b"})
    st = c.wait_phase("second", "Failed", "Completed", "RolledBack")
    assert "already being migrated by PodLiveMigration 'first'" in st["message"]
    c.kubelets["node-a"].hold.set()
    st = c.wait_phase("first", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed" and st["targetNode"] == "node-b"
    assert {ctr: c.sim.restored[(st["restoredPod"]["name"], ctr)] for ctr in before} == before


def held_in_checkpoint(c: Cluster, name: str) -> dict[str, str]:
    """Start the workload and a migration of it whose checkpoint waits in the kubelet until released."""
    before = c.start_workload()
    c.kubelets["node-a"].hold.clear()
    c.migrate(name, {"podName": "heapsrv", "targetNode": "node-b"})
    wait_for(lambda: c.kubelets["node-a"].waiting, 60, "the checkpoint to start", step=0.05)
    return before


def test_an_operator_restarted_mid_migration_resumes_it(cluster: Cluster) -> None:
    c = cluster
    before = held_in_checkpoint(c, "resumed")
    assert c.status("resumed")["phase"] == "Checkpointing"
    c.operator.kill()  # SIGKILL: no chance to write anything
    c.operator.start()
    c.kubelets["node-a"].hold.set()
    st = c.wait_phase("resumed", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    assert {ctr: c.sim.restored[(st["restoredPod"]["name"], ctr)] for ctr in before} == before
    assert any(r == "Resumed" for r, _ in c.events())
    assert c.archives("node-a") == []  # the interrupted checkpoint's archives were replaced, not leaked


def test_deleting_a_running_migration_rolls_it_back(cluster: Cluster) -> None:
    c = cluster
    before = held_in_checkpoint(c, "cancelled")
    c.api.delete(f"{PLMS}/cancelled")
    c.kubelets["node-a"].hold.set()
    wait_for(lambda: c.api.get(f"{PLMS}/cancelled") is None, 60, "the migration to be gone")
    pod = c.api.get(k.pods(NS, "heapsrv"))
    assert pod is not None and k.pod_ready(pod) and c.heap_digests("node-a", "heapsrv") == before
    assert [p for p in c.api.list(k.pods(NS)) if p["metadata"]["name"] != "heapsrv"] == []
    assert c.archives("node-a") == []


def test_checkpointing_some_containers_warns_and_starts_the_others_fresh(cluster: Cluster) -> None:
    c = cluster
    before = c.start_workload()
    c.migrate("partial", {"podName": "heapsrv", "targetNode": "node-b", "containers": ["server"]})
    st = c.wait_phase("partial", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    assert c.kubelets["node-a"].calls == [(NS, "heapsrv", "server")]
    restored = st["restoredPod"]["name"]
    pod = c.api.get(k.pods(NS, restored))
    assert pod is not None
    images = {x["name"]: x["image"] for x in pod["spec"]["containers"]}
    assert images["sidecar"] == "localhost/sidecar:1" and images["server"] == st["checkpointImages"]["server"]
    assert c.sim.restored[(restored, "server")] == before["server"]
    assert (restored, "sidecar") not in c.sim.restored
    warnings = [m for r, m in c.events() if r == "PartialCheckpoint"]
    assert warnings and "severed" in warnings[0]


def test_an_operator_that_died_mid_rollback_finishes_the_rollback_not_the_migration(cluster: Cluster) -> None:
    """The record an operator left when it died while undoing a failed restore: the copy is already
    deleted but not yet recorded so; the Services' pin and the archives are still there. The next
    operator must finish the undo (each undo is idempotent), never run the migration on."""
    c = cluster
    before = c.start_workload()
    archive = c.kubelets["node-a"].dir / "podmigrate-20261201000000-abcdef-server.tar"
    archive.write_bytes(b"memory")
    c.api.patch(k.pods(NS, "heapsrv"), {"metadata": {"annotations": {"podmigrate.io/migration": "crashed"},
                                                     "labels": {"podmigrate.io/instance": "heapsrv"}}})  # fmt: skip
    c.api.patch(k.services(NS, "web"), {"spec": {"selector": {"app": "heapsrv", "podmigrate.io/instance": "heapsrv"}}})
    spec = {"podName": "heapsrv", "targetNode": "node-b", "mode": "decoupled", "transport": "registry",
            "compression": "none", "timeouts": {"checkpointSeconds": 120, "restoreSeconds": 300}}  # fmt: skip
    phases = [{"name": n, "started": 1.0, "ended": 2.0} for n in ("validate", "checkpoint", "restore")]
    record = {
        "status": "rolling_back", "id": "20261201000000-abcdef", "phase": "restore", "spec": spec,
        "source": "node-a", "target": "node-b", "containers": ["server"], "restored": "heapsrv-mabcdef",
        "services": {"web": {"app": "heapsrv"}}, "phases": phases, "done": ["validate", "checkpoint"],
        "rollbacks": [],
        "error": {"message": "restore failed: CreateContainerError"}, "owner": "dead-operator",
    }  # fmt: skip
    meta = {"name": "crashed", "namespace": NS, "resourceVersion": "1"}
    c.api.create(PLMS, {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration", "metadata": meta,
                        "spec": spec, "status": {"phase": "Restoring", "record": record}})  # fmt: skip
    st = c.wait_phase("crashed", "RolledBack", "Failed", "Completed")
    assert st["phase"] == "RolledBack", st
    assert not archive.exists() and c.kubelets["node-a"].calls == []  # undone, nothing redone
    assert c.api.get(k.services(NS, "web"))["spec"]["selector"] == {"app": "heapsrv"}  # type: ignore[index]
    pod = c.api.get(k.pods(NS, "heapsrv"))
    assert pod is not None and "podmigrate.io/migration" not in pod["metadata"].get("annotations", {})
    assert c.heap_digests("node-a", "heapsrv") == before
    assert [r["phase"] for r in st["record"]["rollbacks"]] == ["restore", "checkpoint"]
