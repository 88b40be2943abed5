"""What goes wrong on a real cluster, and what a client outside it sees, on upstream Kubernetes with
podmigrate installed (``conftest.installed``): CRIU failing inside the kubelet's checkpoint, no agent
on the source node, the copy's pod deleted as it starts, the Service deleted before the cutover, a
checkpoint image changed in the registry between push and pull (both restore paths), the RuntimeClass
refusing restores it cannot do, an operator gone in the middle of a rollback, two migrations of one
pod at once (the pod's lock: 409 Conflict), and a client probing the Service from the LAN at 50 Hz:
stop-copy never shows it an older state, decoupled does (its drift); a client connection held open
through the checkpoint."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.k8s.agents import Config
from podmigrate.kube import image, install
from podmigrate.kube.cluster import KubeCluster
from podmigrate.kube.prober import Prober, blackout, went_back
from podmigrate.lab.host import join

from .conftest import wait_for
from .kube_helpers import (
    NS,
    Watch,
    apply_list,
    events,
    final,
    get,
    kept,
    leftovers,
    migrate,
    other,
    plm,
    services_as_before,
    serving,
)

pytestmark = pytest.mark.lab


@pytest.fixture
def cluster(installed: KubeCluster) -> KubeCluster:
    return installed


def rolled_back(cluster: KubeCluster, name: str, source: dict[str, Any], before: dict[str, Any], phase: str) -> Any:
    """The migration rolled back from ``phase``: the source pod alone serves, unlocked, with its heap
    and process; no archive is left on any node."""
    st = final(cluster, name)
    assert st["phase"] == "RolledBack", st.get("message")
    assert st["record"]["phase"] == phase, st["record"]
    pod, after = serving(cluster)
    assert pod["metadata"]["name"] == source["metadata"]["name"]
    assert "podmigrate.io/migration" not in (pod["metadata"].get("annotations") or {})
    kept(before, after)
    services_as_before(cluster)
    assert "RolledBack" in [r for r, _ in events(cluster, name)]
    wait_for(lambda: leftovers(cluster) == {n: [] for n in cluster.lab.nodes}, 60, "no checkpoint archive left")
    return st


def test_criu_failing_in_the_kubelets_checkpoint_rolls_back(cluster: KubeCluster, example: dict[str, Any]) -> None:
    """A process of the sidecar holds a 3 MB file it deleted: CRIU refuses to dump a deleted file over
    its ghost limit (1 MB), as it would an application's temporary file."""
    pod, before = serving(cluster)
    ghost = "head -c 3000000 /dev/urandom >/tmp/g && (exec 3</tmp/g; rm /tmp/g; exec sleep 100000) >/dev/null 2>&1 &"
    cluster.kubectl(["exec", "-n", NS, pod["metadata"]["name"], "-c", "sidecar", "--", "sh", "-c", ghost])
    st = rolled_back(cluster, migrate(cluster, plm("ghost", {})), pod, before, "checkpoint")
    assert "criu failed" in st["message"] and "criu-dump.log" in st["message"], st["message"]
    assert "CRIU's dump log" in st["record"]["error"]["hint"]


def test_no_agent_on_the_source_node_fails_before_anything_moves(cluster: KubeCluster, example: dict[str, Any]) -> None:
    pod, before = serving(cluster)
    source = pod["spec"]["nodeName"]
    not_there = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [source]}]}
    away = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [not_there]}}}
    ds = ["-n", install.NS, "daemonset/podmigrate-agent"]
    cluster.kubectl(["patch", *ds, "-p", json.dumps({"spec": {"template": {"spec": {"affinity": away}}}})])
    try:

        def agents() -> set[str]:
            return {p["spec"]["nodeName"] for p in get(cluster, "pods", "-n", install.NS)["items"]
                    if p["metadata"]["name"].startswith("podmigrate-agent-")}  # fmt: skip

        wait_for(lambda: source not in agents(), 120, f"no agent left on {source}", 0.5)
        st = final(cluster, migrate(cluster, plm("no-agent", {})))
    finally:
        cluster.kubectl(["patch", *ds, "-p", json.dumps({"spec": {"template": {"spec": {"affinity": None}}}})])
        cluster.kubectl([*ds[:2], "rollout", "status", ds[2], "--timeout=180s"], timeout=200)
    assert st["phase"] in ("Failed", "RolledBack"), st
    assert f"no ready podmigrate agent on node '{source}'" in st["message"], st["message"]
    after_pod, after = serving(cluster)
    assert after_pod["metadata"]["name"] == pod["metadata"]["name"]
    kept(before, after)
    services_as_before(cluster)  # the Services were handed over before the agent was asked: given back


def test_the_copy_deleted_as_it_starts_rolls_back(cluster: KubeCluster, example: dict[str, Any]) -> None:
    pod, before = serving(cluster)

    def delete_copy(obj: dict[str, Any]) -> bool:
        if obj["metadata"]["name"] == pod["metadata"]["name"]:
            return False
        cluster.kubectl(["delete", "pod", "-n", NS, obj["metadata"]["name"], "--wait=false"])
        return True

    with Watch(cluster, ["pods", "-n", NS, "-l", "app=heapsrv"], delete_copy) as w:
        st = rolled_back(cluster, migrate(cluster, plm("vanish", {})), pod, before, "restore")
    assert w.acted.is_set() and "vanished" in st["message"], st["message"]


@pytest.mark.parametrize("mode", ["decoupled", "stop-copy"])
def test_the_service_deleted_before_the_cutover_rolls_back(
    cluster: KubeCluster, example: dict[str, Any], mode: str
) -> None:
    """Both hand the Service over (stop-copy empties the operator's slice at its isolation): the
    rollback gives the source its Service's own slices back and leaves none of the operator's."""
    pod, before = serving(cluster)

    def delete_service(obj: dict[str, Any]) -> bool:
        if (obj.get("status") or {}).get("phase") != "Restoring":
            return False
        cluster.kubectl(["delete", "service", "-n", NS, "heapsrv", "--wait=false"])
        return True

    with Watch(cluster, ["plm", "-n", NS, "--field-selector", "metadata.name=svc-gone"], delete_service) as w:
        st = rolled_back(cluster, migrate(cluster, plm("svc-gone", {"mode": mode})), pod, before, "cutover")
    assert w.acted.is_set() and "heapsrv" in st["message"], st["message"]


class Tamper:
    """Changes every checkpoint image the registry receives once its push is complete (its tag
    written): bytes of the first layer flipped, same size, as it is stored on disk."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.v2 = cluster.lab.dir / "registry/docker/registry/v2"
        self.done: set[Path] = set()
        self.stop = threading.Event()

    def _blob(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.v2 / "blobs/sha256" / hexd[:2] / hexd / "data"

    def _run(self) -> None:
        old = set((self.v2 / "repositories/checkpoints").glob("*/_manifests/tags/*/current/link"))
        while not self.stop.wait(0.01):
            for link in set((self.v2 / "repositories/checkpoints").glob("*/_manifests/tags/*/current/link")) - old:
                if link in self.done or not link.read_text():
                    continue
                manifest = json.loads(self._blob(link.read_text().strip()).read_bytes())
                data = self._blob(manifest["layers"][0]["digest"])
                with open(data, "r+b") as f:
                    f.seek(4096)
                    chunk = f.read(64)
                    f.seek(4096)
                    f.write(bytes(b ^ 0xFF for b in chunk))
                assert hashlib.sha256(data.read_bytes()).hexdigest() != manifest["layers"][0]["digest"][7:]
                self.done.add(link)

    def __enter__(self) -> Tamper:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.mark.parametrize("path", ["cri", "runtimeclass"])
def test_a_checkpoint_image_changed_in_the_registry_is_never_restored(
    cluster: KubeCluster, example: dict[str, Any], path: str
) -> None:
    """containerd checks each layer's digest as it pulls (cri); the target's agent checks the digests
    the operator recorded before it writes the mark the handler needs (runtimeclass)."""
    pod, before = serving(cluster)
    with Tamper(cluster) as t:
        st = rolled_back(cluster, migrate(cluster, plm(f"tampered-{path}", {"restorePath": path})), pod, before,
                         "restore")  # fmt: skip
    assert len(t.done) == 2  # both containers' images
    if path == "cri":
        assert "ErrImagePull" in st["message"] and "digest" in st["message"].lower(), st["message"]
    else:
        assert "refusing to restore" in st["message"], st["message"]


def test_the_runtimeclass_refuses_a_restore_it_cannot_do_instead_of_starting_fresh(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    """A pod that asks the handler to restore a container but names no checkpoint for it (or one no
    agent verified, or a directory elsewhere) does not start: the reason is in the container's status."""
    node = cluster.lab.nodes[-1]
    fake = "/var/lib/podmigrate/restore/fake/server/checkpoint"
    cluster.lab.run(node, ["sh", "-c", f"mkdir -p {fake} && echo [] > {fake}/descriptors.json"])
    cases = {
        "no-source": ({"io.podmigrate.restore": "server"}, "no io.podmigrate.restore-from.server reached the runtime"),
        "unverified": ({"io.podmigrate.restore": "server",
                        "io.podmigrate.restore-from.server": "/var/lib/podmigrate/restore/fake/server"},
                       "has no podmigrate-verified.json"),
        "outside": ({"io.podmigrate.restore": "server", "io.podmigrate.restore-from.server": "/etc"},
                    "is not a checkpoint directory under /var/lib/podmigrate/restore"),
    }  # fmt: skip
    ref = image.node_reference(image.project_image())
    items = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": ann},
              "spec": {"nodeName": node, "runtimeClassName": "podmigrate", "terminationGracePeriodSeconds": 1,
                       "containers": [{"name": "server", "image": ref, "command": ["sleep", "1000"]}]}}
             for name, (ann, _) in cases.items()]  # fmt: skip
    apply_list(cluster, items)
    try:
        for name, (_, message) in cases.items():

            def refused(name: str = name) -> str | None:
                statuses = get(cluster, "pod", "-n", NS, name).get("status", {}).get("containerStatuses") or [{}]
                waiting = statuses[0].get("state", {}).get("waiting") or {}
                ok = waiting.get("reason") in ("CreateContainerError", "RunContainerError")
                return waiting.get("message") if ok else None

            got = wait_for(refused, 120, f"{name} refused", 0.5)
            assert "podmigrate-runc" in got and message in got, got
    finally:
        cluster.kubectl(["delete", "pods", "-n", NS, *cases, "--grace-period=1", "--wait=true"], check=False)
        cluster.lab.run(node, ["rm", "-rf", "/var/lib/podmigrate/restore/fake"])


def test_without_the_runtimeclass_its_path_is_refused_before_the_freeze(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, before = serving(cluster)
    cluster.kubectl(["delete", "runtimeclass", "podmigrate"])
    try:
        st = final(cluster, migrate(cluster, plm("no-class", {"restorePath": "runtimeclass"})))
    finally:
        cluster.kubectl(["apply", "-k", str(cluster.paths.host / "install")])
    assert st["phase"] == "Failed" and st["reason"] == "UnsupportedRuntime", st
    assert "no podmigrate RuntimeClass" in st["message"] and "cannot restore a checkpoint" in st["message"]
    assert set(st.get("phaseTimings") or {}) <= {"validate"}  # refused before any checkpoint
    after_pod, after = serving(cluster)
    assert after_pod["metadata"]["name"] == pod["metadata"]["name"]
    kept(before, after)


def test_an_operator_gone_mid_rollback_finishes_the_rollback_not_the_migration(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    """The record an operator leaves when it dies while undoing a failed restore: the copy already
    deleted but not yet recorded so; the Service's pin, the pod's lock and an archive still there.
    The next operator finishes the undo (each undo is idempotent) and never runs the migration on."""
    pod, before = serving(cluster)
    source, name = pod["spec"]["nodeName"], pod["metadata"]["name"]
    deploy = ["-n", install.NS, "deployment/podmigrate-operator"]
    cluster.kubectl(["scale", *deploy, "--replicas=0"])
    operator = "app.kubernetes.io/name=podmigrate-operator"
    wait_for(lambda: not get(cluster, "pods", "-n", install.NS, "-l", operator)["items"], 120, "no operator", 0.5)
    try:
        archive = "/var/lib/kubelet/checkpoints/podmigrate-20261201000000-abcdef-server.tar"
        cluster.lab.run(source, ["sh", "-c", f"echo memory > {archive}"])
        cluster.kubectl(["annotate", "pod", "-n", NS, name, "podmigrate.io/migration=crashed"])
        cluster.kubectl(["label", "pod", "-n", NS, name, f"podmigrate.io/instance={name}"])
        pin = {"spec": {"selector": {"app": "heapsrv", "podmigrate.io/instance": name}}}
        cluster.kubectl(["patch", "service", "-n", NS, "heapsrv", "-p", json.dumps(pin)])
        spec = {"podName": name, "targetNode": other(cluster, source), "mode": "decoupled", "transport": "registry",
                "compression": "none", "restorePath": "cri", "service": "heapsrv",
                "timeouts": {"checkpointSeconds": 120, "restoreSeconds": 300}}  # fmt: skip
        phases = [{"name": n, "started": 1.0, "ended": 2.0} for n in ("validate", "checkpoint", "restore")]
        record = {
            "status": "rolling_back", "id": "20261201000000-abcdef", "phase": "restore", "spec": spec,
            "source": source, "target": spec["targetNode"], "containers": ["server"], "restored": "heapsrv-mabcdef",
            "restore_path": "cri", "services": {"heapsrv": {"app": "heapsrv"}}, "phases": phases,
            "done": ["validate", "checkpoint"], "rollbacks": [],
            "error": {"message": "restore failed: CreateContainerError"}, "owner": "dead-operator",
        }  # fmt: skip
        cluster.kubectl(["apply", "-n", NS, "-f", "-"], input=json.dumps(plm("crashed", spec)))
        status = {"status": {"phase": "Restoring", "record": record}}
        cluster.kubectl(["patch", "plm", "-n", NS, "crashed", "--subresource=status", "--type=merge",
                         "-p", json.dumps(status)])  # fmt: skip
    finally:
        cluster.kubectl(["scale", *deploy, "--replicas=1"])
    st = final(cluster, "crashed")
    assert st["phase"] == "RolledBack", st
    assert [r["phase"] for r in st["record"]["rollbacks"]] == ["restore", "checkpoint"]
    assert st["record"]["done"] == ["validate", "checkpoint"]  # nothing redone
    assert get(cluster, "service", "-n", NS, "heapsrv")["spec"]["selector"] == {"app": "heapsrv"}
    after_pod, after = serving(cluster)
    assert after_pod["metadata"]["name"] == name
    assert "podmigrate.io/migration" not in (after_pod["metadata"].get("annotations") or {})
    kept(before, after)
    assert leftovers(cluster) == {n: [] for n in cluster.lab.nodes}  # the archive was the undo's to delete


def test_two_migrations_of_one_pod_at_once_lock_it_once(cluster: KubeCluster, example: dict[str, Any]) -> None:
    """Both are applied in one request: the operator validates them side by side, both read the pod
    unlocked, and the API server answers the second lock 409 Conflict (its resourceVersion is old)."""
    _pod, before = serving(cluster)
    items = [plm("twin-1", {}), plm("twin-2", {})]
    apply_list(cluster, items)
    got = {n: final(cluster, n) for n in ("twin-1", "twin-2")}
    assert sorted(s["phase"] for s in got.values()) == ["Completed", "Failed"], got
    loser = next(n for n, s in got.items() if s["phase"] == "Failed")
    winner = next(n for n in got if n != loser)
    assert f"already being migrated by PodLiveMigration '{winner}'" in got[loser]["message"]
    kept(before, serving(cluster)[1])


def probe_while(cluster: KubeCluster, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The migration ``body`` probed from the LAN through the Service's NodePort on the first node,
    until 20 answers came after it ended; its status and the probes."""
    port = get(cluster, "service", "-n", NS, "heapsrv")["spec"]["ports"][0]["nodePort"]
    with Prober(cluster.lab, layout.node_ip(cluster.lab.nodes[0]), port) as p:
        wait_for(lambda: p.answered() >= 10, 30, "answers before the migration")
        st = final(cluster, migrate(cluster, body))
        ended = time.time()
        wait_for(lambda: sum(1 for s in p.samples if s["ok"] and s["t"] > ended) >= 20, 60, "answers after it")
    return st, p.samples


def test_a_client_outside_the_cluster_sees_stop_copy_keep_its_state_and_decoupled_drift(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    _pod, before = serving(cluster)
    st, samples = probe_while(cluster, plm("probed-sc", {"mode": "stop-copy"}))
    assert st["phase"] == "Completed", st.get("message")
    # every answer from one process whose counter never went back: nothing answered after the checkpoint
    assert went_back(samples) == [] and {s["started"] for s in samples if s["ok"]} == {before["started"]}
    gap = blackout(samples)
    assert gap["failed"] > 0 and st["blackoutSeconds"] > 0, gap  # the client saw the freeze
    copy, _ = serving(cluster)
    st, samples = probe_while(cluster, plm("probed-dc", {"podName": copy["metadata"]["name"], "mode": "decoupled"}))
    assert st["phase"] == "Completed" and st["driftSeconds"] > 0, st.get("message")
    # the copy restored from a checkpoint the source had run past: the client saw its counter go back
    assert went_back(samples), samples[-5:]
    kept(before, serving(cluster)[1])


def test_a_runtimeclass_migration_there_and_back_keeps_its_key_out_of_every_record(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, before = serving(cluster)
    st = final(cluster, migrate(cluster, plm("rc-there", {"restorePath": "runtimeclass"})))
    assert st["phase"] == "Completed" and st["restorePath"] == "runtimeclass", st.get("message")
    assert st["record"]["sealed"] is True and "seal" not in st["record"]
    master = (cluster.paths.host / "podmigrate-ca" / "seal.key").read_text().strip()
    key = Config(seal_master=master).seal_key(st["record"]["id"])
    log = cluster.kubectl(["logs", "-n", install.NS, "deployment/podmigrate-operator", "--tail=-1"]).stdout
    assert key and key not in json.dumps(st) and key not in log and master not in log
    reasons = [r for r, _ in events(cluster, "rc-there")]
    for r in ("Validate", "RestorePath", "Checkpoint", "Package", "Restore", "Cutover", "Cleanup", "Completed"):
        assert r in reasons, reasons
    copy, after = serving(cluster)
    assert copy["spec"]["runtimeClassName"] == "podmigrate" and copy["spec"]["nodeName"] != pod["spec"]["nodeName"]
    assert copy["metadata"]["annotations"]["io.podmigrate.restore"] == "server,sidecar"
    kept(before, after)
    st = final(cluster, migrate(cluster, plm("rc-back", {"podName": copy["metadata"]["name"],
                                                         "restorePath": "runtimeclass"})))  # fmt: skip
    assert st["phase"] == "Completed", st.get("message")
    back, after = serving(cluster)
    assert back["spec"]["nodeName"] == pod["spec"]["nodeName"] and len(back["metadata"]["name"]) == len(
        copy["metadata"]["name"]
    )  # the name does not grow
    kept(before, after)
    # the operator's metrics, as Prometheus scrapes them (host network: its node's address)
    op = get(cluster, "pods", "-n", install.NS, "-l", "app.kubernetes.io/name=podmigrate-operator")["items"][0]
    url = f"http://{op['status']['podIP']}:8080/metrics"
    metrics = cluster.lab.run("lan", ["curl", "-s", "--max-time", "5", url]).stdout
    assert 'podmigrate_migrations_total{mode="decoupled",result="completed"}' in metrics, metrics[-2000:]
    for node in cluster.lab.nodes:  # each target's verified checkpoints were removed after its restore
        ls = cluster.lab.run(node, ["sh", "-c", "ls /var/lib/podmigrate/restore 2>/dev/null || true"])
        assert ls.stdout.split() == [], (node, ls.stdout)


def test_a_client_connection_open_through_the_checkpoint_does_not_fail_it(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    """Without CRIU's ``tcp-close`` for containerd's containers, any connection open at the instant of
    the kubelet's checkpoint fails it ("Connected TCP socket"): a Service under traffic could never
    move. With it the copy restores such a connection closed; the source keeps its own."""
    pod, before = serving(cluster)
    ip = pod["status"]["podIP"]
    hold = (
        f"import socket, time; s = socket.create_connection(('{ip}', 8000)); print('open', flush=True); time.sleep(600)"
    )
    cmd, cgroup = cluster.lab.command("lan", ["python3", "-c", hold])
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=join(cgroup))
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "open"
        st = final(cluster, migrate(cluster, plm("held-open", {})))
        assert st["phase"] == "Completed", st.get("message")
    finally:
        client.kill()
        client.wait()
    copy, after = serving(cluster)
    assert copy["spec"]["nodeName"] != pod["spec"]["nodeName"]
    kept(before, after)
