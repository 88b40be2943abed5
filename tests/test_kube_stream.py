"""Streamed migrations on upstream Kubernetes (``transport: stream``): the copy's pod waits on the
target before the freeze, the source's agent checkpoints with runc and its pages go straight into
the copy over the agents' sealed relay; and when the dump fails, the waiting copy goes and the
source serves on with its state."""

from __future__ import annotations

from typing import Any

import pytest

from podmigrate.k8s import handover
from podmigrate.k8s.context import INSTANCE
from podmigrate.kube.cluster import KubeCluster
from podmigrate.runtime import prefetch

from .conftest import wait_for
from .kube_helpers import NS, final, get, kept, leftovers, migrate, plm, serving
from .test_kube_faults import rolled_back

pytestmark = pytest.mark.lab

RESTORE_DIR = "/var/lib/podmigrate/restore"


@pytest.fixture
def cluster(installed: KubeCluster) -> KubeCluster:
    return installed


def unpacked(kube: KubeCluster) -> dict[str, list[str]]:
    """Checkpoints left in each node's restore directory (process memory: nothing may stay)."""
    return {n: kube.lab.run(n, ["sh", "-c", f"ls {RESTORE_DIR} 2>/dev/null || true"]).stdout.split()
            for n in kube.lab.nodes}  # fmt: skip


def handed_back(kube: KubeCluster) -> bool:
    """No EndpointSlice of podmigrate's is left, and the example's Service has its own selector."""
    left = get(kube, "endpointslices", "-n", NS, "-l", handover.OURS)["items"]
    svc = get(kube, "service", "heapsrv", "-n", NS)
    assert left == [], [s["metadata"]["name"] for s in left]
    assert INSTANCE not in svc["spec"]["selector"], svc["spec"]["selector"]
    return True


def streamed(name: str, pod: str) -> dict[str, Any]:
    body = plm(name, {"mode": "stop-copy", "transport": "stream"})
    body["spec"]["podName"] = pod
    return body


def test_a_streamed_stop_copy_moves_the_pod_into_a_copy_that_waited_for_it(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, before = serving(cluster)
    name = pod["metadata"]["name"]
    st = final(cluster, migrate(cluster, streamed("streamed", name)))
    assert st["phase"] == "Completed", st.get("message")
    assert st["transport"] == "stream" and st["restorePath"] == "runtimeclass"
    rec = st["record"]
    # the copy existed and waited before the source was touched: its phase ran first, the pod was made in it
    order = [p["name"] for p in rec["phases"]]
    assert order == ["validate", "page-server", "checkpoint", "restore", "cutover", "pages", "cleanup"], order
    # paused for its dump, not isolated first: the blackout starts at the freeze
    assert "isolated_at" not in rec and rec["frozen_at"] <= rec["checkpointed_at"] <= rec["cutover_at"]
    assert st["blackoutSeconds"] == pytest.approx(rec["cutover_at"] - rec["frozen_at"], abs=0.002)
    # the first container's pages went through its page server; the sidecar's came whole beside it
    assert rec["stream"]["server"]["pages_bytes"] > 64 << 20
    # the copy ran before they were all in it: a local daemon copied them in behind it (pages)
    assert rec["stream"]["server"]["pages_s"] > 0 and rec["stream"]["server"]["pages_mb_s"] > 0
    assert rec["stream"]["sidecar"]["pages_bytes"] == 0 and rec["stream"]["sidecar"]["rest_bytes"] > 0
    copy, after = serving(cluster)
    assert copy["metadata"]["name"] == st["restoredPod"]["name"] and copy["spec"]["nodeName"] != pod["spec"]["nodeName"]
    assert copy["spec"]["runtimeClassName"] == "podmigrate"
    # handed over at the address its sandbox had; then the Service's own selector and slices again
    assert rec["pod_ip"] == copy["status"]["podIP"]
    assert handed_back(cluster)
    # every node's connection tracking forgot the source's address (conntrack ran there, as root)
    source_ip = pod["status"]["podIP"]
    assert {n: sorted(done.get("deleted") or {}) for n, done in rec["conntrack"].items()} == {
        n: [source_ip] for n in cluster.lab.nodes
    }, rec["conntrack"]
    kept(before, after)
    wait_for(lambda: not get(cluster, "pods", "-n", NS, "--field-selector", f"metadata.name={name}")["items"], 60,
             "the source pod to be gone")  # fmt: skip
    wait_for(lambda: unpacked(cluster) == {n: [] for n in cluster.lab.nodes}, 60, "no checkpoint left unpacked")
    assert leftovers(cluster) == {n: [] for n in cluster.lab.nodes}


def test_a_streamed_checkpoint_that_fails_takes_the_waiting_copy_away(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    """The sidecar holds a 3 MB file it deleted (over CRIU's ghost limit): runc's dump of it fails
    after the server's pages went into the copy, which is waiting to restore them."""
    pod, before = serving(cluster)
    ghost = "head -c 3000000 /dev/urandom >/tmp/g && (exec 3</tmp/g; rm /tmp/g; exec sleep 100000) >/dev/null 2>&1 &"
    cluster.kubectl(["exec", "-n", NS, pod["metadata"]["name"], "-c", "sidecar", "--", "sh", "-c", ghost])
    st = rolled_back(
        cluster, migrate(cluster, streamed("streamed-ghost", pod["metadata"]["name"])), pod, before, "checkpoint"
    )
    assert "runc checkpoint of sidecar failed" in st["message"], st["message"]
    restored = st["record"]["restored"]
    wait_for(lambda: not get(cluster, "pods", "-n", NS, "--field-selector", f"metadata.name={restored}")["items"], 60,
             "the waiting copy to be gone")  # fmt: skip
    assert handed_back(cluster)
    wait_for(lambda: unpacked(cluster) == {n: [] for n in cluster.lab.nodes}, 60, "no checkpoint left unpacked")


def test_a_lazy_migration_serves_from_the_copy_before_its_memory_has_moved(
    cluster: KubeCluster, example: dict[str, Any]
) -> None:
    pod, before = serving(cluster)
    body = plm("lazy", {"mode": "lazy"})
    body["spec"]["podName"] = pod["metadata"]["name"]
    st = final(cluster, migrate(cluster, body))
    assert st["phase"] == "Completed", st.get("message")
    assert st["transport"] == "stream"
    rec = st["record"]
    assert [p["name"] for p in rec["phases"]][-3:] == ["cutover", "pages", "cleanup"]
    server = rec["stream"]["server"]
    # the heap came after the copy ran: through the source's CRIU, not in the checkpoint's rest, which
    # carried the small mappings' pages the copy's first request touches (at most the prefetch budget)
    assert server["lazy"] and server["pages_bytes"] > 64 << 20
    assert 0 < server["prefetch"]["bytes"] <= prefetch.DEFAULT_MB << 20, server["prefetch"]
    assert server["rest_bytes"] < (16 + prefetch.DEFAULT_MB) << 20
    copy, after = serving(cluster)
    assert copy["metadata"]["name"] == st["restoredPod"]["name"] and copy["spec"]["nodeName"] != pod["spec"]["nodeName"]
    kept(before, after)
    wait_for(lambda: unpacked(cluster) == {n: [] for n in cluster.lab.nodes}, 60, "no checkpoint left unpacked")
