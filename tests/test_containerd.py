"""containerd 2.1 on the lab's nodes (``lab up --runtime containerd``), driven over its real CRI
socket from the host: a container checkpointed on node-a by CRI ``CheckpointContainer``, moved as a
checkpoint image through the lab's registry, restored on node-b by CRI ``CreateContainer`` with its
heap and its process intact; ``checkpointctl`` reads containerd's and Podman's archives."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.lab.cluster import Lab
from podmigrate.lab.containerd import NODE_REGISTRY
from podmigrate.transport.registry import checkpoint_annotations
from podmigrate.workload import manage
from podmigrate.workload.image import workload_image
from tests.conftest import wait_for

pytestmark = pytest.mark.lab
cri = pytest.importorskip("podmigrate.cri.api_pb2")
from podmigrate.cri import CRIClient  # noqa: E402


@pytest.fixture(scope="module")
def clab(containerd_lab: Lab) -> Lab:
    return containerd_lab


def client(lab: Lab, node: str) -> CRIClient:
    return CRIClient(lab.dir / "cri" / f"{node}.sock", timeout=300)


def sandbox(name: str) -> Any:
    uid = f"uid-{name}"
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace="default"),
        log_directory=f"/var/log/pods/{uid}",
        linux=cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(
                # the node's own network namespace: the pod answers at the node's address
                namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
            )
        ),
    )


def state_at(lab: Lab, node: str) -> dict[str, Any] | None:
    return manage.read_state(lab, layout.node_ip(node), 8000, timeout=2)


def test_each_node_runs_containerd_2_1_with_a_cri_socket_the_host_reaches(clab):
    for node in clab.nodes:
        with client(clab, node) as c:
            v = c.version()
        assert v.runtime_name == "containerd" and v.runtime_version.startswith("2.1."), v
    assert clab.status()["runtime"] == "containerd"


def test_a_container_moves_between_nodes_through_cri_checkpoint_and_restore_with_its_heap(clab):
    image = workload_image().replace(layout.REGISTRY, NODE_REGISTRY)
    cid = f"cri-{uuid.uuid4().hex[:6]}"
    archive = f"{layout.NODE_CHECKPOINTS}/{cid}.tar"
    reference = f"{layout.REGISTRY}/podmigrate/checkpoints/{cid}:1"
    made: list[tuple[str, str]] = []  # (node, pod) to remove afterwards
    try:
        with client(clab, "node-a") as a:
            a.pull_image(image)
            config = sandbox(f"src-{cid}")
            pod = a.run_pod_sandbox(config)
            made.append(("node-a", pod))
            ctr_config = cri.ContainerConfig(
                metadata=cri.ContainerMetadata(name="heapsrv"),
                image=cri.ImageSpec(image=image),
                log_path="heapsrv.log",
                envs=[cri.KeyValue(key="HEAP_MB", value="32")],
            )
            ctr = a.create_container(pod, ctr_config, config)
            a.start_container(ctr)
            before = wait_for(lambda: state_at(clab, "node-a"), 120, "the heap server on node-a")
            a.checkpoint_container(ctr, archive, timeout=120)
            shown = clab.run("node-a", ["checkpointctl", "show", archive]).stdout
            assert "heapsrv" in shown and "containerd" in shown, shown
            a.stop_container(ctr)  # the source stops: the copy's state is the checkpoint's
        agent = clab.agent("node-a")
        pushed = agent.post(
            f"/v1/checkpoints/{cid}/push", {"reference": reference, "annotations": checkpoint_annotations("heapsrv")}
        )
        agent.delete(f"/v1/checkpoints/{cid}")
        with client(clab, "node-b") as b:
            ckpt = reference.replace(layout.REGISTRY, NODE_REGISTRY)
            b.pull_image(ckpt)
            config = sandbox(f"dst-{cid}")
            pod = b.run_pod_sandbox(config)
            made.append(("node-b", pod))
            restored = cri.ContainerConfig(
                metadata=cri.ContainerMetadata(name="heapsrv"), image=cri.ImageSpec(image=ckpt), log_path="heapsrv.log"
            )
            ctr = b.create_container(pod, restored, config)  # containerd 2.1: a checkpoint image restores
            b.start_container(ctr)
            after = wait_for(lambda: state_at(clab, "node-b"), 120, "the restored heap server on node-b")
            status = b.container_status(ctr).status
        assert after["sha256"] == before["sha256"] and after["started"] == before["started"]
        assert after["counter"] >= before["counter"]
        assert status.state == cri.CONTAINER_RUNNING and pushed["bytes"] > 32 << 20
    finally:
        for node, pod in made:
            with client(clab, node) as c, contextlib.suppress(Exception):
                c.stop_pod_sandbox(pod)
                c.remove_pod_sandbox(pod)


def test_checkpointctl_reads_podmans_archives_too(clab):
    cid = f"ck-{uuid.uuid4().hex[:6]}"
    manage.start(clab, cid, "node-a", 16)
    agent = clab.agent("node-a")
    try:
        agent.post(f"/v1/containers/{cid}/checkpoint", {"checkpoint_id": cid, "leave_running": True})
        podman_archive = f"{layout.NODE_CHECKPOINTS}/{cid}.tar"
        out = clab.run("node-a", ["checkpointctl", "show", podman_archive])
        assert cid in out.stdout and "Podman" in out.stdout, out.stdout
        inspect = clab.run("node-a", ["checkpointctl", "inspect", "--all", podman_archive])
        assert "CRIU dump statistics" in inspect.stdout, inspect.stdout
    finally:
        agent.delete(f"/v1/checkpoints/{cid}")
        manage.stop(clab, cid)
