"""The operator's cases that need hooks inside the kubelet, on the emulated API server (kmock) with the
project's own CRI kubelet (``kubelab``) over each node's real containerd 2.1 and CRIU: a checkpoint
failing inside CRIU, a Service read at the instant of each checkpoint, the copy's pod vanishing as it
starts, the Service deleted at cutover, an image tampered with between push and pull, an operator
killed mid-rollback. The node agent, the registry, kopf and the operator process, and the podmigrate
RuntimeClass are real. Every other case runs on upstream Kubernetes: ``tests/test_kube_operator.py``
and ``tests/test_kube_cases.py``.
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from podmigrate import layout
from podmigrate.cri import CRIClient
from podmigrate.errors import CRIError, PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s.agents import Config
from podmigrate.kubelab import example
from podmigrate.kubelab.cluster import AGENT_NS, KubeLab
from podmigrate.kubelab.kubelet import Kubelet, KubeletError
from podmigrate.kubelab.pods import KUBELET_LABEL, PodWorker
from podmigrate.lab.cluster import Lab
from podmigrate.lab.containerd import NODE_REGISTRY
from tests.conftest import wait_for

pytestmark = pytest.mark.lab
NS = "default"
PLMS = "/apis/podmigrate.io/v1alpha1/namespaces/default/podlivemigrations"
RCS = "/apis/node.k8s.io/v1/runtimeclasses"


class HookedKubelet(Kubelet):
    """The real kubelet, with places for a test to watch or break it."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[str, str, str]] = []
        self.fail_with: int | None = None  # answer checkpoints with this status
        self.hold = threading.Event()  # cleared: checkpoints wait until it is set again
        self.hold.set()
        self.waiting = 0
        self.on_call: Callable[[], Any] | None = None  # at each checkpoint request, before it runs
        self.on_start: Callable[[dict[str, Any]], Any] | None = None  # before a pod's sandbox is made
        self.on_status: Callable[[dict[str, Any]], Any] | None = None  # after a pod's status is written

    def checkpoint(self, namespace: str, pod: str, container: str, timeout: int) -> str:
        self.calls.append((namespace, pod, container))
        if self.on_call:
            self.on_call()
        self.waiting += 1
        self.hold.wait()
        self.waiting -= 1
        if self.fail_with:
            raise KubeletError("checkpointing failed: criu dump failed", details={"status": self.fail_with})
        return super().checkpoint(namespace, pod, container, timeout)

    def _start(self, w: PodWorker) -> None:
        if self.on_start:
            self.on_start(w.pod)
        super()._start(w)

    def _write_status(self, w: PodWorker) -> None:
        super()._write_status(w)
        if self.on_status:
            self.on_status(w.pod)


@pytest.fixture(scope="module")
def klab(containerd_lab: Lab) -> Lab:
    return containerd_lab


class Cluster:
    def __init__(self, lab: Lab, tmp: Path):
        self.lab = lab
        # 127.0.0.1:9 (nothing listens): the registry-down fault, allowed so that it fails at the push
        allowed = [f"{NODE_REGISTRY}/checkpoints", "127.0.0.1:9/checkpoints"]
        self.kl = KubeLab(lab, tmp, kubelet_class=HookedKubelet, poll_s=0.05, allowed_registries=allowed).start()
        self.api = self.kl.api
        self.image = example.image()
        for node, ready in (("node-c", "False"),):  # a node that is not Ready (no kubelet)
            status = {"conditions": [{"type": "Ready", "status": ready}]}
            self.api.create(k.nodes(), {"metadata": {"name": node}, "status": status})

    def kubelet(self, node: str) -> HookedKubelet:
        kubelet = self.kl.nodes[node].kubelet
        assert isinstance(kubelet, HookedKubelet)
        return kubelet

    def start_workload(self, name: str = "heapsrv", node: str = "node-a", heap_mb: int = 16) -> dict[str, Any]:
        """The example pod (heap server + sidecar) and its Service; the heap's state once it answers."""
        return example.start_example(self.api, name, node, heap_mb)

    def state(self, node: str) -> dict[str, Any]:
        return example.state(node, timeout=60)

    def migrate(self, name: str, spec: dict[str, Any]) -> None:
        example.migrate(self.api, name, spec)

    def status(self, name: str) -> dict[str, Any]:
        return (self.api.get(f"{PLMS}/{name}") or {}).get("status") or {}

    def wait_phase(self, name: str, *phases: str, timeout: float = 180) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            st = self.status(name)
            return st if st.get("phase") in phases else None

        try:
            result: dict[str, Any] = wait_for(done, timeout, f"{name} to reach {phases}", step=0.1)
        except AssertionError:
            errors = {n: self.kubelet(n).errors[-5:] for n in self.kl.nodes}
            raise AssertionError(
                f"{self.status(name)}\n--- kubelets: {errors}\n--- operator log:\n{self.kl.operator_log()[-4000:]}"
            ) from None
        return result

    def events(self) -> list[tuple[str, str]]:
        return [(e.get("reason", ""), e.get("message", "")) for e in self.api.list(f"/api/v1/namespaces/{NS}/events")]

    def archives(self, node: str) -> list[Path]:
        return sorted(self.kl.nodes[node].checkpoints.glob("*.tar"))

    def has_image(self, reference: str) -> bool:
        return manifest_of(reference).status_code == 200

    def sandboxes(self, node: str) -> list[Any]:
        return self.kubelet(node).cri.list_pod_sandbox({KUBELET_LABEL: node})

    def close(self) -> None:
        self.kl.close()


@pytest.fixture
def cluster(klab: Lab, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(klab, tmp_path)
    yield c
    c.close()
    for node in klab.nodes:  # the kubelets removed every pod they ran
        with CRIClient(klab.dir / "cri" / f"{node}.sock") as cri:
            assert cri.list_pod_sandbox({KUBELET_LABEL: node}) == [], node


def same_process(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return bool(after["sha256"] == before["sha256"] and after["started"] == before["started"])


def assert_rolled_back(c: Cluster, name: str, before: dict[str, Any]) -> dict[str, Any]:
    st = c.wait_phase(name, "RolledBack", "Failed")
    assert st["phase"] == "RolledBack", st
    pod = c.api.get(k.pods(NS, "heapsrv"))
    assert pod is not None and pod["spec"]["nodeName"] == "node-a" and k.pod_ready(pod)
    assert "podmigrate.io/migration" not in (pod["metadata"].get("annotations") or {})
    assert same_process(before, c.state("node-a"))  # the source was never touched, and still serves
    svc = c.api.get(k.services(NS, "web"))
    assert svc is None or k.selects(svc["spec"]["selector"], pod["metadata"]["labels"]), svc
    rec = st["record"]
    assert c.api.get(k.pods(NS, rec["restored"])) is None
    assert not [r for r in rec.get("references", {}).values() if c.has_image(r)]
    assert c.archives("node-a") == []
    assert any(r == "RolledBack" for r, _ in c.events())
    return st


def manifest_of(reference: str) -> httpx.Response:
    """The registry's answer for ``reference`` (``localhost:5000/...`` on the nodes: the lab's registry)."""
    repo, _, tag = reference.partition("/")[2].rpartition(":")
    accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
    return httpx.get(f"http://{layout.REGISTRY}/v2/{repo}/manifests/{tag}", headers=accept)


def tamper(c: Cluster, reference: str) -> None:
    """Flip bytes in the checkpoint layer as the registry stores it (same size, other content)."""
    manifest = manifest_of(reference).json()
    digest = manifest["layers"][0]["digest"].split(":")[1]
    data = c.lab.dir / "registry/docker/registry/v2/blobs/sha256" / digest[:2] / digest / "data"
    with open(data, "r+b") as f:
        f.seek(4096)
        chunk = f.read(64)
        f.seek(4096)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert hashlib.sha256(data.read_bytes()).hexdigest() != digest


# ------------------------------------------------------------------------------------------ tests
def test_each_kubelet_registers_its_node_with_the_runtime_it_drives(cluster: Cluster) -> None:
    for node in ("node-a", "node-b"):
        n = cluster.api.get(k.nodes(node))
        assert n is not None and k.node_ready(n)
        assert n["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.1.")
        assert {"type": "InternalIP", "address": layout.node_ip(node)} in n["status"]["addresses"]


@pytest.mark.parametrize("path", ["cri", "runtimeclass"])
def test_decoupled_migration_moves_the_pod_with_its_memory_there_and_back(cluster: Cluster, path: str) -> None:
    c = cluster
    before = c.start_workload()
    c.migrate("move-1", {"podName": "heapsrv", "targetNode": "node-b", "restorePath": path})
    st = c.wait_phase("move-1", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    assert st["restorePath"] == path
    # sealed where the target's agent reads the image (runtimeclass); containerd reads it itself (cri)
    assert st["record"]["sealed"] is (path == "runtimeclass") and "seal" not in st["record"]
    key = Config(seal_master=c.kl.seal_master).seal_key(st["record"]["id"])
    assert key and key not in json.dumps(st) and key not in c.kl.operator_log()  # the key is in no record or log
    restored = st["restoredPod"]["name"]
    assert st["restoredPod"]["node"] == "node-b" and restored.startswith("heapsrv-m")
    # both containers were checkpointed through the kubelet of the source node, nothing else
    assert sorted(c.kubelet("node-a").calls) == [(NS, "heapsrv", "server"), (NS, "heapsrv", "sidecar")]
    assert c.kubelet("node-b").calls == []
    # the copy on node-b is the same process with the same memory, bit for bit
    assert same_process(before, c.state("node-b"))
    pod = c.api.get(k.pods(NS, restored))
    assert pod is not None and pod["spec"]["nodeName"] == "node-b"
    images = {x["name"]: x["image"] for x in pod["spec"]["containers"]}
    if path == "cri":  # the checkpoint images, by the digest the source pushed
        assert all(i.startswith(f"{NODE_REGISTRY}/checkpoints/") and "@sha256:" in i for i in images.values())
    else:  # the original images; the RuntimeClass restored from what the target's agent verified
        assert set(images.values()) == {c.image} and pod["spec"]["runtimeClassName"] == "podmigrate"
        assert pod["metadata"]["annotations"]["io.podmigrate.restore"] == "server,sidecar"
    # the Service selects exactly the restored pod; the source is gone; no archive or tag is left
    assert c.api.get(k.services(NS, "web"))["spec"]["selector"] == {"app": "heapsrv"}  # type: ignore[index]
    assert c.api.get(k.pods(NS, "heapsrv")) is None
    assert c.archives("node-a") == [] and not any(c.has_image(i) for i in st["checkpointImages"].values())
    assert not list((c.lab.dir / "nodes/node-b/podmigrate-restore").iterdir())
    assert set(st["phaseTimings"]) == {"validate", "checkpoint", "package", "restore", "cutover", "cleanup"}
    assert {x["type"]: x["status"] for x in st["conditions"]} == {"Progressing": "False", "Succeeded": "True"}
    assert st["bytes"] > 16 << 20 and st["blackoutSeconds"] == 0 and st["driftSeconds"] > 0
    reasons = [r for r, _ in c.events()]
    for r in ("Validate", "RestorePath", "Checkpoint", "Package", "Restore", "Cutover", "Cleanup", "Completed"):
        assert r in reasons, reasons
    # and back: node-b's kubelet checkpoints the copy; the name does not grow
    c.migrate("move-2", {"podName": restored, "targetNode": "node-a", "restorePath": path})
    st2 = c.wait_phase("move-2", "Completed", "Failed", "RolledBack")
    assert st2["phase"] == "Completed", st2
    back = st2["restoredPod"]["name"]
    assert back.startswith("heapsrv-m") and len(back) == len(restored) and st2["restoredPod"]["node"] == "node-a"
    assert same_process(before, c.state("node-a"))
    metrics = httpx.get(f"http://127.0.0.1:{c.kl.metrics_port}/metrics").text
    assert 'podmigrate_migrations_total{mode="decoupled",result="completed"} 2.0' in metrics


def test_stop_copy_takes_the_source_out_of_service_before_its_checkpoint(cluster: Cluster) -> None:
    c = cluster
    before = c.start_workload()
    seen: list[dict[str, str]] = []
    c.kubelet("node-a").on_call = lambda: seen.append(c.api.get(k.services(NS, "web"))["spec"]["selector"])  # type: ignore[index]
    c.migrate("sc", {"podName": "heapsrv", "targetNode": "node-b", "mode": "stop-copy"})
    st = c.wait_phase("sc", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    # at each checkpoint the Service selected no pod: nothing could change the state after it
    assert len(seen) == 2 and all(s["podmigrate.io/instance"].startswith("isolated-") for s in seen)
    assert st["driftSeconds"] == 0 and st["blackoutSeconds"] > 0
    assert same_process(before, c.state("node-b"))
    assert set(st["phaseTimings"]) >= {"isolate", "checkpoint"}


@pytest.mark.parametrize(
    "fault",
    ["kubelet-fails", "no-agent", "registry-down", "tampered", "target-lost", "service-deleted", "containerd-killed"],
)
def test_a_failure_at_each_step_rolls_back_and_keeps_the_source(cluster: Cluster, fault: str) -> None:
    c = cluster
    before = c.start_workload()
    spec: dict[str, Any] = {"podName": "heapsrv", "targetNode": "node-b", "timeouts": {"restoreSeconds": 20}}
    target = c.kubelet("node-b")

    def restored(pod: dict[str, Any]) -> bool:
        return bool(pod["metadata"]["name"] != "heapsrv")

    if fault == "kubelet-fails":
        c.kubelet("node-a").fail_with = 500
    elif fault == "no-agent":
        c.api.delete(k.pods(AGENT_NS, "podmigrate-agent-node-a"))
    elif fault == "registry-down":
        spec["registry"] = "127.0.0.1:9/checkpoints"
    elif fault == "tampered":  # someone changes the image in the registry after the push
        spec["restorePath"] = "cri"

        def tamper_first(pod: dict[str, Any]) -> None:
            if restored(pod):
                for ref in c.status("doomed")["record"]["images"].values():
                    tamper(c, ref)
                target.on_start = None

        target.on_start = tamper_first
    elif fault == "target-lost":  # its node dies as the copy starts
        target.on_start = lambda pod: restored(pod) and c.api.delete(k.pods(NS, pod["metadata"]["name"]))
    elif fault == "service-deleted":  # someone deletes the Service as the copy comes up
        target.on_status = lambda pod: restored(pod) and c.api.delete(k.services(NS, "web"))
    elif fault == "containerd-killed":  # the target's runtime dies while it restores, and stays down a while
        hold = c.lab.dir / "hold" / "containerd-node-b"

        def kill(pod: dict[str, Any]) -> None:
            if restored(pod):
                hold.touch()
                # this lab's containerd by its pid file, never by name: other labs and the host run one
                c.lab.kill_service("containerd-node-b", signal.SIGKILL)
                target.on_start = None

        target.on_start = kill
    c.migrate("doomed", spec)
    try:
        st = assert_rolled_back(c, "doomed", before)
    finally:
        if fault == "containerd-killed":
            (c.lab.dir / "hold" / "containerd-node-b").unlink(missing_ok=True)
    failed_in = {
        "kubelet-fails": {"checkpoint"},
        "no-agent": {"checkpoint"},
        "registry-down": {"package"},
        "tampered": {"restore"},
        "target-lost": {"restore"},
        "service-deleted": {"cutover"},
        "containerd-killed": {"restore"},
    }[fault]
    assert st["record"]["phase"] in failed_in, st["record"]
    message = st["message"]
    if fault == "kubelet-fails":
        assert "criu dump failed" in message and "CRIU" in st["record"]["error"]["hint"]
    if fault == "no-agent":
        assert "no ready podmigrate agent on node 'node-a'" in message and "could not delete" in message
    if fault == "tampered":  # containerd checks the layer's digest as it pulls: nothing restored
        assert "ErrImagePull" in message and "digest" in message.lower(), message
    if fault == "target-lost":
        assert "vanished" in message
    if fault == "containerd-killed":
        assert "not ready after 20 s" in message or "CRI" in message, message

        # the runtime comes back (the lab restarts it), and the kubelet removes the copy's sandbox
        def cleaned() -> bool:
            try:
                return not c.sandboxes("node-b")
            except CRIError:  # still restarting
                return False

        wait_for(cleaned, 120, "node-b's sandboxes to be removed", step=0.5)


def test_the_target_agent_refuses_a_replaced_or_damaged_image_before_anything_restores(cluster: Cluster) -> None:
    """The RuntimeClass path: the target's agent fetches the image and checks the manifest digest the
    operator recorded and the layer's digest before it writes the mark the handler needs to restore."""
    c = cluster
    c.start_workload()
    source, target = c.kl.agent("node-a"), c.kl.agent("node-b")
    body = {"namespace": NS, "pod": "heapsrv", "containers": ["server"], "checkpoint_id": "t0", "timeout": 60}
    archives = source.post("/v1/checkpoints", body)["archives"]
    ref = f"{NODE_REGISTRY}/checkpoints/refusal:t0"
    archive = Path(archives["server"]["path"])
    made = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()  # what containerd wrote
    pushed = source.post(
        "/v1/images", {**body, "archives": {"server": archives["server"]["path"]}, "references": {"server": ref}}
    )
    digest = pushed["images"]["server"]["manifest_digest"]
    # the image's one layer is exactly the runtime's archive, and both runtimes' annotations are on it
    manifest = manifest_of(ref).json()
    assert [x["digest"] for x in manifest["layers"]] == [made]
    assert {"io.kubernetes.cri-o.annotations.checkpoint.name", "org.criu.checkpoint.container.name"} <= set(
        manifest.get("annotations") or {}
    ), manifest.get("annotations")
    restores = c.lab.dir / "nodes/node-b/podmigrate-restore"

    def fetch(cid: str, want: str) -> Any:
        return target.post(
            "/v1/restores",
            {"checkpoint_id": cid, "namespace": NS, "images": {"server": {"reference": ref, "digest": want}}},
        )

    with pytest.raises(PodmigrateError, match="not the checkpoint image that was pushed"):
        fetch("t1", "sha256:" + "0" * 64)
    good = fetch("t2", digest)["restores"]["server"]
    assert good["path"] == "/var/lib/podmigrate/restore/t2/server"
    assert (restores / "t2/server/podmigrate-verified.json").exists()
    assert (restores / "t2/server/checkpoint/descriptors.json").stat().st_mode & 0o077 == 0
    tamper(c, ref)
    with pytest.raises(PodmigrateError, match="refusing to restore"):
        fetch("t3", digest)
    assert not list(restores.glob("t[13]/**/podmigrate-verified.json"))
    for cid in ("t1", "t2", "t3"):
        target.post("/v1/restores/delete", {"checkpoint_id": cid})
    source.post("/v1/images/delete", {"references": [ref]})
    assert not list(restores.iterdir())


def test_the_operator_restores_through_the_runtimeclass_where_cri_restore_is_gone(cluster: Cluster) -> None:
    """There through CRI (containerd 2.1); back to a node that reports containerd 2.4 (CRI restore
    removed): auto takes the RuntimeClass, with the pod's own images (not the first hop's checkpoint
    images, deleted since). With no RuntimeClass either, the migration fails before anything is frozen."""
    c = cluster
    before = c.start_workload()
    c.migrate("there", {"podName": "heapsrv", "targetNode": "node-b"})
    st = c.wait_phase("there", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed" and st["restorePath"] == "cri", st
    info = {"status": {"nodeInfo": {"containerRuntimeVersion": "containerd://2.4.0"}}}
    c.api.patch(k.nodes("node-a") + "/status", info)
    c.migrate("back", {"podName": st["restoredPod"]["name"], "targetNode": "node-a"})
    st = c.wait_phase("back", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed" and st["restorePath"] == "runtimeclass", st
    assert any(r == "RestorePath" and "removed in 2.4" in m for r, m in c.events())
    assert same_process(before, c.state("node-a"))
    pod = c.api.get(k.pods(NS, st["restoredPod"]["name"]))
    assert pod is not None and {x["image"] for x in pod["spec"]["containers"]} == {c.image}
    c.api.delete(f"{RCS}/podmigrate")
    c.api.patch(k.nodes("node-b") + "/status", info)
    calls = len(c.kubelet("node-a").calls)
    c.migrate("nowhere", {"podName": st["restoredPod"]["name"], "targetNode": "node-b"})
    st = c.wait_phase("nowhere", "Failed", "Completed", "RolledBack")
    assert st["phase"] == "Failed" and st["reason"] == "UnsupportedRuntime", st
    assert "node 'node-b' cannot restore a checkpoint" in st["message"] and "removed in 2.4" in st["message"]
    assert "no podmigrate RuntimeClass" in st["message"]
    assert len(c.kubelet("node-a").calls) == calls  # refused before any checkpoint
    # and a cold restart of the RuntimeClass copy starts the pod's own images, without the class
    c.migrate("cold", {"podName": pod["metadata"]["name"], "targetNode": "node-b", "mode": "cold"})
    st = c.wait_phase("cold", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    fresh = c.api.get(k.pods(NS, st["restoredPod"]["name"]))
    assert fresh is not None and "runtimeClassName" not in fresh["spec"]
    assert not [a for a in fresh["metadata"]["annotations"] if a.startswith("io.podmigrate.")]


def test_the_runtimeclass_refuses_a_restore_it_cannot_do_instead_of_starting_fresh(cluster: Cluster) -> None:
    """A pod that asks the handler to restore a container but names no checkpoint for it (or one the
    agent never verified) does not start: the reason is in the container's status."""
    c = cluster
    fake = c.lab.dir / "nodes/node-b/podmigrate-restore/fake/server/checkpoint"
    fake.mkdir(parents=True)
    (fake / "descriptors.json").write_text("[]")  # looks like a checkpoint, but was never verified
    cases = {
        "no-source": ({"io.podmigrate.restore": "server"}, "no io.podmigrate.restore-from.server reached the runtime"),
        "unverified": ({"io.podmigrate.restore": "server",
                        "io.podmigrate.restore-from.server": "/var/lib/podmigrate/restore/fake/server"},
                       "has no podmigrate-verified.json"),
        "outside": ({"io.podmigrate.restore": "server", "io.podmigrate.restore-from.server": "/etc"},
                    "is not a checkpoint directory under /var/lib/podmigrate/restore"),
    }  # fmt: skip
    for name, (ann, _) in cases.items():
        c.api.create(k.pods(NS), {
            "metadata": {"name": name, "namespace": NS, "annotations": ann},
            "spec": {"nodeName": "node-b", "runtimeClassName": "podmigrate", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "server", "image": c.image, "command": ["python3", "/app/heapsrv.py"],
                                     "env": [{"name": "HEAP_MB", "value": "1"}]}]},
        })  # fmt: skip
    for name, (_, message) in cases.items():

        def refused(name: str = name) -> str | None:
            cs = ((c.api.get(k.pods(NS, name)) or {}).get("status") or {}).get("containerStatuses") or [{}]
            waiting = cs[0].get("state", {}).get("waiting") or {}
            return (
                waiting.get("message")
                if waiting.get("reason") in ("CreateContainerError", "RunContainerError")
                else None
            )

        got = wait_for(refused, 60, f"{name} refused")
        assert "podmigrate-runc" in got and message in got, got
        c.api.delete(k.pods(NS, name))
    import shutil

    shutil.rmtree(fake.parents[1])


def held_in_checkpoint(c: Cluster, name: str) -> dict[str, Any]:
    """Start the workload and a migration of it whose checkpoint waits in the kubelet until released."""
    before = c.start_workload()
    c.kubelet("node-a").hold.clear()
    c.migrate(name, {"podName": "heapsrv", "targetNode": "node-b"})
    wait_for(lambda: c.kubelet("node-a").waiting, 60, "the checkpoint to start", step=0.05)
    return before


def test_an_operator_restarted_mid_migration_resumes_it(cluster: Cluster) -> None:
    c = cluster
    before = held_in_checkpoint(c, "resumed")
    assert c.status("resumed")["phase"] == "Checkpointing"
    c.kl.stop_operator(kill=True)  # SIGKILL: no chance to write anything
    c.kl.start_operator()
    c.kubelet("node-a").hold.set()
    st = c.wait_phase("resumed", "Completed", "Failed", "RolledBack")
    assert st["phase"] == "Completed", st
    assert same_process(before, c.state("node-b"))
    assert any(r == "Resumed" for r, _ in c.events())
    assert c.archives("node-a") == []  # the interrupted checkpoint's archives were replaced, not leaked


def test_an_operator_that_died_mid_rollback_finishes_the_rollback_not_the_migration(cluster: Cluster) -> None:
    """The record an operator left when it died while undoing a failed restore: the copy is already
    deleted but not yet recorded so; the Services' pin and the archives are still there. The next
    operator must finish the undo (each undo is idempotent), never run the migration on."""
    c = cluster
    before = c.start_workload()
    archive = c.kl.nodes["node-a"].checkpoints / "podmigrate-20261201000000-abcdef-server.tar"
    archive.write_bytes(b"memory")
    c.api.patch(k.pods(NS, "heapsrv"), {"metadata": {"annotations": {"podmigrate.io/migration": "crashed"},
                                                     "labels": {"podmigrate.io/instance": "heapsrv"}}})  # fmt: skip
    c.api.patch(k.services(NS, "web"), {"spec": {"selector": {"app": "heapsrv", "podmigrate.io/instance": "heapsrv"}}})
    spec = {"podName": "heapsrv", "targetNode": "node-b", "mode": "decoupled", "transport": "registry",
            "compression": "none", "restorePath": "auto",
            "timeouts": {"checkpointSeconds": 120, "restoreSeconds": 300}}  # fmt: skip
    phases = [{"name": n, "started": 1.0, "ended": 2.0} for n in ("validate", "checkpoint", "restore")]
    record = {
        "status": "rolling_back", "id": "20261201000000-abcdef", "phase": "restore", "spec": spec,
        "source": "node-a", "target": "node-b", "containers": ["server"], "restored": "heapsrv-mabcdef",
        "restore_path": "cri", "services": {"web": {"app": "heapsrv"}}, "phases": phases,
        "done": ["validate", "checkpoint"], "rollbacks": [],
        "error": {"message": "restore failed: CreateContainerError"}, "owner": "dead-operator",
    }  # fmt: skip
    meta = {"name": "crashed", "namespace": NS, "resourceVersion": "1"}
    c.api.create(PLMS, {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration", "metadata": meta,
                        "spec": spec, "status": {"phase": "Restoring", "record": record}})  # fmt: skip
    st = c.wait_phase("crashed", "RolledBack", "Failed", "Completed")
    assert st["phase"] == "RolledBack", st
    assert not archive.exists() and c.kubelet("node-a").calls == []  # undone, nothing redone
    assert c.api.get(k.services(NS, "web"))["spec"]["selector"] == {"app": "heapsrv"}  # type: ignore[index]
    pod = c.api.get(k.pods(NS, "heapsrv"))
    assert pod is not None and "podmigrate.io/migration" not in pod["metadata"].get("annotations", {})
    assert same_process(before, c.state("node-a"))
    assert [r["phase"] for r in st["record"]["rollbacks"]] == ["restore", "checkpoint"]
