"""Helpers of the tests on the lab's upstream Kubernetes with podmigrate installed (``conftest.kube``,
``conftest.installed``): kubectl as JSON, the example pod's state read from the LAN at its address,
PodLiveMigrations applied and waited for."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podmigrate.kube.cluster import KubeCluster

from .conftest import wait_for

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
NS = "default"
FINAL = ("Completed", "Failed", "RolledBack")


def get(kube: KubeCluster, *args: str) -> Any:
    return json.loads(kube.kubectl(["get", "-o", "json", *args]).stdout)


def heap_pods(kube: KubeCluster) -> list[dict[str, Any]]:
    return [p for p in get(kube, "pods", "-n", NS, "-l", "app=heapsrv")["items"]
            if not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def state_at(kube: KubeCluster, ip: str) -> dict[str, Any] | None:
    p = kube.lab.run("lan", ["curl", "-s", "--max-time", "3", f"http://{ip}:8000/state"], check=False)
    try:
        return dict(json.loads(p.stdout)) if p.returncode == 0 else None
    except ValueError:
        return None


def nodes_settled(kube: KubeCluster) -> bool:
    """Every node Ready, schedulable and without the node lifecycle controller's taints
    (``node.kubernetes.io/not-ready`` outlives a kubelet's Ready by seconds: a test right after one
    that killed a node's containerd found no target for its migration)."""
    for n in get(kube, "nodes")["items"]:
        ready = [c for c in n["status"].get("conditions") or [] if c["type"] == "Ready"]
        taints = [t for t in n["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
        if not ready or ready[0]["status"] != "True" or n["spec"].get("unschedulable") or taints:
            return False
    return True


def serving(kube: KubeCluster) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one heapsrv pod there is, once it is Ready and answers, and its state."""

    def one() -> tuple[dict[str, Any], dict[str, Any]] | None:
        pods = heap_pods(kube)
        if len(pods) != 1 or not all(c.get("ready") for c in pods[0]["status"].get("containerStatuses") or [{}]):
            return None
        st = state_at(kube, pods[0]["status"]["podIP"])
        return (pods[0], st) if st else None

    return wait_for(one, 180, "one heapsrv pod serving")


def migrate(kube: KubeCluster, body: dict[str, Any] | None = None) -> str:
    """Apply a PodLiveMigration (default: the user's file as it is); its name."""
    text = json.dumps(body) if body else (DEPLOY / "examples" / "podlivemigration.yaml").read_text()
    kube.kubectl(["apply", "-n", NS, "-f", "-"], input=text)
    return str(body["metadata"]["name"]) if body else "heapsrv-move"


def final(kube: KubeCluster, name: str, timeout: float = 300) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        st = get(kube, "plm", name, "-n", NS).get("status") or {}
        return st if st.get("phase") in FINAL else None

    return wait_for(done, timeout, f"PodLiveMigration {name} to finish", 0.5)


def kept(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after["sha256"] == before["sha256"]
    assert after["started"] == before["started"]  # the same process, not a restart
    assert after["counter"] >= before["counter"]


def services_as_before(kube: KubeCluster) -> None:
    """The example's Service (unless deleted) selects by its own labels only, and no EndpointSlice of podmigrate's is
    left: no migration's pin or handover outlived it."""
    for svc in get(kube, "services", "-n", NS, "--field-selector", "metadata.name=heapsrv")["items"]:  # if not deleted
        assert svc["spec"]["selector"] == {"app": "heapsrv"}
    ours = get(kube, "endpointslices", "-n", NS, "-l", "endpointslice.kubernetes.io/managed-by=podmigrate.io")
    assert [s["metadata"]["name"] for s in ours["items"]] == []


def leftovers(kube: KubeCluster) -> dict[str, list[str]]:
    """Checkpoint archives left in each node's kubelet directory (memory: the agent removes them)."""
    out = {}
    for node in kube.lab.nodes:
        p = kube.lab.run(node, ["sh", "-c", "ls /var/lib/kubelet/checkpoints 2>/dev/null || true"])
        out[node] = p.stdout.split()
    return out


def phase_of(kube: KubeCluster, name: str) -> str:
    return str((get(kube, "plm", name, "-n", NS).get("status") or {}).get("phase", ""))


def plm(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration", "metadata": {"name": name},
            "spec": {"podName": "heapsrv", "service": "heapsrv", **spec}}  # fmt: skip


def apply_list(kube: KubeCluster, items: list[dict[str, Any]]) -> None:
    kube.kubectl(["apply", "-n", NS, "-f", "-"], input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def events(kube: KubeCluster, name: str) -> list[tuple[str, str]]:
    got = get(kube, "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")["items"]
    return [(e["reason"], e["message"]) for e in got]


def other(kube: KubeCluster, node: str) -> str:
    return next(n for n in kube.lab.nodes if n != node)


class Watch:
    """``kubectl get ARGS --watch`` in a thread: ``act(object)`` on every version of the objects it
    shows, from the first, until ``act`` returns True (a test's reaction, at the API server's pace)."""

    def __init__(self, kube: KubeCluster, args: list[str], act: Callable[[dict[str, Any]], bool]) -> None:
        self.kube, self.args, self.act = kube, args, act
        self.acted = threading.Event()
        self.errors: list[BaseException] = []

    def __enter__(self) -> Watch:
        argv = self.kube.kubectl_argv(["get", *self.args, "--watch", "-o", "json"])
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        assert self.proc.stdout is not None
        text = ""
        for line in self.proc.stdout:
            text += line
            if line.rstrip("\n") != "}" or self.acted.is_set():  # each object ends with "}" alone on a line
                text = "" if line.rstrip("\n") == "}" else text
                continue
            try:
                obj, text = json.loads(text), ""
                if self.act(obj):
                    self.acted.set()
            except Exception as e:  # kept: raised in the test's thread at the end
                self.errors.append(e)
                self.acted.set()

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=10)
        if self.errors:
            raise self.errors[0]
