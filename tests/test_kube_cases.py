"""The operator's cases on upstream Kubernetes (``conftest.installed``): cold restart, specs refused by the
API server's schema or by the operator with the field named, one migration per pod, a running migration
deleted, some containers checkpointed, a Spot interruption taint evacuating the node, a deadline too
short."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from podmigrate.k8s import evacuation as ev
from podmigrate.kube import image
from podmigrate.kube.cluster import KubeCluster

from .conftest import wait_for
from .kube_helpers import NS, events, final, get, heap_pods, kept, leftovers, migrate, other, phase_of, plm, serving

pytestmark = pytest.mark.lab


@pytest.fixture
def cluster(installed: KubeCluster) -> KubeCluster:
    return installed


def test_cold_restart_starts_a_fresh_pod_and_checkpoints_nothing(cluster: KubeCluster, example: dict[str, Any]) -> None:
    pod, before = serving(cluster)
    st = final(cluster, migrate(cluster, plm("cold", {"mode": "cold"})))
    assert st["phase"] == "Completed", st.get("message")
    assert not st.get("checkpointImages")
    copy, after = serving(cluster)
    assert copy["spec"]["nodeName"] != pod["spec"]["nodeName"]
    assert {c["image"] for c in copy["spec"]["containers"]} == {image.node_reference(image.project_image())}
    read_at = time.time()
    # state lost: a process started anew, whose counter is no more than it could count since
    assert after["started"] != before["started"] and after["counter"] <= (read_at - after["started"]) / 0.01 + 1
    assert leftovers(cluster) == {n: [] for n in cluster.lab.nodes}


def test_bad_specs_are_refused_by_the_api_server_or_fail_naming_the_field(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, _before = serving(cluster)
    here = pod["spec"]["nodeName"]
    # the CRD's schema: the real API server refuses these at create, nothing reaches the operator
    for spec, field in (({"mode": "warp"}, "spec.mode"), ({"restorePath": "magic"}, "spec.restorePath")):
        p = cluster.kubectl(["apply", "-n", NS, "-f", "-"], input=json.dumps(plm("refused", spec)), check=False)
        assert p.returncode and "Unsupported value" in p.stderr and field in p.stderr, p.stderr
    cluster.kubectl(["taint", "node", other(cluster, here), "gpu=yes:NoSchedule"])
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "no-pod": ({"podName": "nope"}, "spec.podName: there is no pod 'nope'"),
        "same-node": ({"targetNode": here}, f"already runs on '{here}'"),
        "no-node": ({"targetNode": "node-z"}, "there is no node 'node-z'"),
        "no-such-container": ({"containers": ["db"]}, "has no container db"),
        "tainted": ({"targetNode": other(cluster, here)}, "does not tolerate its taint gpu:NoSchedule"),
        "foreign-registry": ({"registry": "evil.example:5000/loot"},
                             "spec.registry 'evil.example:5000/loot' is not in the allowed registries"),
        "stream-cri": ({"transport": "stream", "restorePath": "cri"},
                       "spec.restorePath: a streamed checkpoint is restored by the podmigrate RuntimeClass"),
        "stream-cold": ({"transport": "stream", "mode": "cold"}, "spec.transport: a cold restart moves no checkpoint"),
    }  # fmt: skip
    for name, (spec, _) in cases.items():
        migrate(cluster, plm(name, spec))
    for name, (_, message) in cases.items():
        st = final(cluster, name)
        assert st["phase"] == "Failed" and message in st["message"], (name, st)
    assert [p["metadata"]["name"] for p in heap_pods(cluster)] == [pod["metadata"]["name"]]  # nothing started
    assert leftovers(cluster) == {n: [] for n in cluster.lab.nodes}


def test_one_migration_per_pod_at_a_time(cluster: KubeCluster, example: dict[str, Any]) -> None:
    _pod, before = serving(cluster)
    migrate(cluster, plm("first", {}))
    wait_for(lambda: phase_of(cluster, "first") == "Checkpointing", 60, "the first checkpoint", 0.05)
    migrate(cluster, plm("second", {}))
    st = final(cluster, "second")
    assert st["phase"] == "Failed" and "already being migrated by PodLiveMigration 'first'" in st["message"], st
    assert final(cluster, "first")["phase"] == "Completed"
    kept(before, serving(cluster)[1])


def test_deleting_a_running_migration_rolls_it_back(cluster: KubeCluster, example: dict[str, Any]) -> None:
    pod, before = serving(cluster)
    migrate(cluster, plm("cancelled", {}))
    wait_for(lambda: phase_of(cluster, "cancelled") == "Checkpointing", 60, "the checkpoint", 0.05)
    cluster.kubectl(["delete", "plm", "cancelled", "-n", NS, "--wait=true", "--timeout=180s"], timeout=200)
    after_pod, after = serving(cluster)
    assert after_pod["metadata"]["name"] == pod["metadata"]["name"]  # the source, the copy removed
    kept(before, after)
    wait_for(lambda: leftovers(cluster) == {n: [] for n in cluster.lab.nodes}, 60, "no archive left")


def test_checkpointing_some_containers_warns_and_starts_the_others_fresh(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    _pod, before = serving(cluster)
    st = final(cluster, migrate(cluster, plm("partial", {"containers": ["server"]})))
    assert st["phase"] == "Completed", st.get("message")
    copy, after = serving(cluster)
    images = {c["name"]: c["image"] for c in copy["spec"]["containers"]}
    assert images["sidecar"] == image.node_reference(image.project_image())
    assert images["server"].startswith("localhost:5000/checkpoints/")
    kept(before, after)  # the server's memory, through a fresh sidecar
    warnings = [m for r, m in events(cluster, "partial") if r == "PartialCheckpoint"]
    assert warnings and "severed" in warnings[0]


def test_a_spot_interruption_taint_evacuates_the_node_with_the_pods_memory(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, before = serving(cluster)
    source = pod["spec"]["nodeName"]
    cluster.kubectl(["taint", "node", source, "aws-node-termination-handler/spot-itn=itn-1:NoSchedule"])

    def finished() -> dict[str, Any] | None:
        done = [e for e in get(cluster, "nev")["items"] if (e.get("status") or {}).get("phase") in ev.TERMINAL]
        return done[0] if done else None

    evac = wait_for(finished, 240, "the NodeEvacuation to finish", 0.5)
    st = evac["status"]
    assert evac["spec"]["reason"] == "aws-node-termination-handler/spot-itn" and st["phase"] == "Completed", st
    assert [(p["name"], p["stateKept"], p["mode"]) for p in st["pods"]] == [
        (pod["metadata"]["name"], True, "stop-copy")
    ]
    # podmigrate's own pods and DaemonSet pods are left where they are
    why = {s["why"].split(" (")[0].split(":")[0] for s in st["skipped"]}
    assert why <= {"a DaemonSet pod", "podmigrate's own pod"}
    assert get(cluster, "node", source)["spec"]["unschedulable"]
    copy, after = serving(cluster)
    assert copy["spec"]["nodeName"] != source
    kept(before, after)


def test_an_evacuation_that_cannot_move_in_time_says_so_and_touches_nothing(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, before = serving(cluster)
    body = {"apiVersion": "podmigrate.io/v1alpha1", "kind": "NodeEvacuation", "metadata": {"name": "too-late"},
            "spec": {"nodeName": pod["spec"]["nodeName"], "deadlineSeconds": 1}}  # fmt: skip
    cluster.kubectl(["apply", "-f", "-"], input=json.dumps(body))

    def done() -> dict[str, Any] | None:
        st = get(cluster, "nev", "too-late").get("status") or {}
        return st if st.get("phase") in ev.TERMINAL else None

    st = wait_for(done, 60, "the evacuation")
    assert st["phase"] == "Incomplete" and st["pods"][0]["phase"] == "Lost", st
    assert f"lost: {pod['metadata']['name']}" in st["message"]
    assert get(cluster, "plm", "-n", NS)["items"] == []
    after_pod, after = serving(cluster)
    assert after_pod["metadata"]["name"] == pod["metadata"]["name"]
    kept(before, after)
