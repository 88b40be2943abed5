"""The CRI client against an in-process gRPC server on a Unix socket (no root, no lab, no runtime).

The fake runtime below keeps pods, containers and images in dicts and answers as containerd does
where that matters (NOT_FOUND for an unknown id, an empty ImageStatus for an unknown image). The
last test regenerates the stubs and checks they equal the committed ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from podmigrate.cri import CRIClient
from podmigrate.cri import api_pb2 as cri
from podmigrate.cri import api_pb2_grpc as cri_grpc
from podmigrate.errors import CRIError, PodmigrateError, RuntimeBackendError

ROOT = Path(__file__).resolve().parent.parent
STUBS = ("api_pb2.py", "api_pb2_grpc.py", "api_pb2.pyi", "api_pb2_grpc.pyi")


class FakeRuntime(cri_grpc.RuntimeServiceServicer, cri_grpc.ImageServiceServicer):
    """Just enough of a CRI runtime for a kubelet's round trip."""

    def __init__(self) -> None:
        self.pods: dict[str, cri.PodSandboxConfig] = {}
        self.containers: dict[str, tuple[str, cri.ContainerConfig, int]] = {}  # id -> pod, config, state
        self.images: dict[str, str] = {}  # name -> ref
        self.checkpoints: list[tuple[str, str, int]] = []

    def Version(self, request: cri.VersionRequest, context: grpc.ServicerContext) -> cri.VersionResponse:
        return cri.VersionResponse(
            version="0.1.0", runtime_name="containerd", runtime_version="v2.1.9", runtime_api_version="v1"
        )

    def RunPodSandbox(
        self, request: cri.RunPodSandboxRequest, context: grpc.ServicerContext
    ) -> cri.RunPodSandboxResponse:
        pod_id = f"pod-{len(self.pods)}"
        self.pods[pod_id] = request.config
        return cri.RunPodSandboxResponse(pod_sandbox_id=pod_id)

    def PodSandboxStatus(
        self, request: cri.PodSandboxStatusRequest, context: grpc.ServicerContext
    ) -> cri.PodSandboxStatusResponse:
        config = self._pod(request.pod_sandbox_id, context)
        status = cri.PodSandboxStatus(
            id=request.pod_sandbox_id,
            metadata=config.metadata,
            state=cri.SANDBOX_READY,
            network=cri.PodSandboxNetworkStatus(ip="10.89.1.7"),
        )
        return cri.PodSandboxStatusResponse(status=status)

    def ListPodSandbox(
        self, request: cri.ListPodSandboxRequest, context: grpc.ServicerContext
    ) -> cri.ListPodSandboxResponse:
        wanted = dict(request.filter.label_selector)
        items = [
            cri.PodSandbox(id=i, metadata=c.metadata, labels=c.labels)
            for i, c in self.pods.items()
            if wanted.items() <= dict(c.labels).items()
        ]
        return cri.ListPodSandboxResponse(items=items)

    def StopPodSandbox(
        self, request: cri.StopPodSandboxRequest, context: grpc.ServicerContext
    ) -> cri.StopPodSandboxResponse:
        for cid, (pod, config, _) in self.containers.items():
            if pod == request.pod_sandbox_id:
                self.containers[cid] = (pod, config, cri.CONTAINER_EXITED)
        return cri.StopPodSandboxResponse()

    def RemovePodSandbox(
        self, request: cri.RemovePodSandboxRequest, context: grpc.ServicerContext
    ) -> cri.RemovePodSandboxResponse:
        self.pods.pop(request.pod_sandbox_id, None)
        self.containers = {k: v for k, v in self.containers.items() if v[0] != request.pod_sandbox_id}
        return cri.RemovePodSandboxResponse()

    def CreateContainer(
        self, request: cri.CreateContainerRequest, context: grpc.ServicerContext
    ) -> cri.CreateContainerResponse:
        self._pod(request.pod_sandbox_id, context)
        if request.config.image.image not in self.images:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f'failed to resolve image "{request.config.image.image}": not found'
            )
        cid = f"ctr-{len(self.containers)}"
        self.containers[cid] = (request.pod_sandbox_id, request.config, cri.CONTAINER_CREATED)
        return cri.CreateContainerResponse(container_id=cid)

    def StartContainer(
        self, request: cri.StartContainerRequest, context: grpc.ServicerContext
    ) -> cri.StartContainerResponse:
        pod, config, _ = self._container(request.container_id, context)
        self.containers[request.container_id] = (pod, config, cri.CONTAINER_RUNNING)
        return cri.StartContainerResponse()

    def StopContainer(
        self, request: cri.StopContainerRequest, context: grpc.ServicerContext
    ) -> cri.StopContainerResponse:
        pod, config, _ = self._container(request.container_id, context)
        self.containers[request.container_id] = (pod, config, cri.CONTAINER_EXITED)
        return cri.StopContainerResponse()

    def RemoveContainer(
        self, request: cri.RemoveContainerRequest, context: grpc.ServicerContext
    ) -> cri.RemoveContainerResponse:
        self.containers.pop(request.container_id, None)
        return cri.RemoveContainerResponse()

    def ContainerStatus(
        self, request: cri.ContainerStatusRequest, context: grpc.ServicerContext
    ) -> cri.ContainerStatusResponse:
        _, config, state = self._container(request.container_id, context)
        status = cri.ContainerStatus(
            id=request.container_id,
            metadata=config.metadata,
            state=cri.ContainerState.ValueType(state),
            image=config.image,
        )
        return cri.ContainerStatusResponse(status=status)

    def ListContainers(
        self, request: cri.ListContainersRequest, context: grpc.ServicerContext
    ) -> cri.ListContainersResponse:
        found = [
            cri.Container(
                id=cid, pod_sandbox_id=pod, metadata=config.metadata, state=cri.ContainerState.ValueType(state)
            )
            for cid, (pod, config, state) in self.containers.items()
            if request.filter.pod_sandbox_id in ("", pod)
        ]
        return cri.ListContainersResponse(containers=found)

    def ExecSync(self, request: cri.ExecSyncRequest, context: grpc.ServicerContext) -> cri.ExecSyncResponse:
        self._container(request.container_id, context)
        return cri.ExecSyncResponse(stdout=" ".join(request.cmd).encode(), exit_code=3)

    def CheckpointContainer(
        self, request: cri.CheckpointContainerRequest, context: grpc.ServicerContext
    ) -> cri.CheckpointContainerResponse:
        self._container(request.container_id, context)
        self.checkpoints.append((request.container_id, request.location, request.timeout))
        return cri.CheckpointContainerResponse()

    def PullImage(self, request: cri.PullImageRequest, context: grpc.ServicerContext) -> cri.PullImageResponse:
        self.images[request.image.image] = f"{request.image.image.rsplit(':', 1)[0]}@sha256:{'ab' * 32}"
        return cri.PullImageResponse(image_ref=self.images[request.image.image])

    def ImageStatus(self, request: cri.ImageStatusRequest, context: grpc.ServicerContext) -> cri.ImageStatusResponse:
        if request.image.image not in self.images:
            return cri.ImageStatusResponse()  # CRI: an unknown image is an empty answer, not an error
        name = request.image.image
        return cri.ImageStatusResponse(image=cri.Image(id=self.images[name], repo_tags=[name]))

    def ListImages(self, request: cri.ListImagesRequest, context: grpc.ServicerContext) -> cri.ListImagesResponse:
        return cri.ListImagesResponse(images=[cri.Image(id=ref, repo_tags=[n]) for n, ref in self.images.items()])

    def RemoveImage(self, request: cri.RemoveImageRequest, context: grpc.ServicerContext) -> cri.RemoveImageResponse:
        self.images.pop(request.image.image, None)
        return cri.RemoveImageResponse()

    def _pod(self, pod_id: str, context: grpc.ServicerContext) -> cri.PodSandboxConfig:
        if pod_id not in self.pods:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f'an error occurred when try to find sandbox "{pod_id}": not found'
            )
        return self.pods[pod_id]

    def _container(self, cid: str, context: grpc.ServicerContext) -> tuple[str, cri.ContainerConfig, int]:
        if cid not in self.containers:
            context.abort(grpc.StatusCode.NOT_FOUND, f'an error occurred when try to find container "{cid}": not found')
        return self.containers[cid]


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[tuple[FakeRuntime, Path]]:
    fake = FakeRuntime()  # type: ignore[abstract]  # the RPCs a test does not call stay unimplemented
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    cri_grpc.add_RuntimeServiceServicer_to_server(fake, server)
    cri_grpc.add_ImageServiceServicer_to_server(fake, server)
    sock = tmp_path / "cri.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield fake, sock
    server.stop(grace=None)


def test_version_names_the_runtime_and_its_cri_version(runtime):
    _, sock = runtime
    with CRIClient(sock, timeout=5) as client:
        v = client.version()
    assert (v.runtime_name, v.runtime_version, v.runtime_api_version) == ("containerd", "v2.1.9", "v1")


def test_a_pod_and_its_container_go_through_their_whole_lifecycle(runtime):
    fake, sock = runtime
    image = "127.0.0.1:5000/stream-server:latest"
    pod_config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="heappod", uid="uid-1", namespace="default"),
        labels={"io.kubernetes.pod.uid": "uid-1"},
        linux=cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
            )
        ),
    )
    config = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="heapsrv"),
        image=cri.ImageSpec(image=image),
        envs=[cri.KeyValue(key="HEAP_MB", value="64")],
    )
    with CRIClient(sock, timeout=5) as client:
        assert client.image_status(image) is None
        ref = client.pull_image(image)
        assert ref.startswith("127.0.0.1:5000/stream-server@sha256:")
        status = client.image_status(image)
        assert status is not None and status.repo_tags == [image]
        assert [i.id for i in client.list_images()] == [ref]

        pod = client.run_pod_sandbox(pod_config)
        assert client.pod_sandbox_status(pod).status.network.ip == "10.89.1.7"
        assert [p.id for p in client.list_pod_sandbox({"io.kubernetes.pod.uid": "uid-1"})] == [pod]
        assert client.list_pod_sandbox({"io.kubernetes.pod.uid": "other"}) == []

        cid = client.create_container(pod, config, pod_config)
        assert client.container_status(cid).status.state == cri.CONTAINER_CREATED
        client.start_container(cid)
        assert client.container_status(cid).status.state == cri.CONTAINER_RUNNING
        assert [(c.id, c.metadata.name) for c in client.list_containers(pod)] == [(cid, "heapsrv")]

        result = client.exec_sync(cid, ["cat", "/proc/1/status"])
        assert (result.exit_code, result.stdout) == (3, b"cat /proc/1/status")  # non-zero exit: a result
        client.checkpoint_container(cid, Path("/var/lib/kubelet/checkpoints/cp.tar"), timeout=60)
        assert fake.checkpoints == [(cid, "/var/lib/kubelet/checkpoints/cp.tar", 60)]

        client.stop_container(cid, grace=1)
        assert client.container_status(cid).status.state == cri.CONTAINER_EXITED
        client.remove_container(cid)
        assert client.list_containers() == []
        client.stop_pod_sandbox(pod)
        client.remove_pod_sandbox(pod)
        assert client.list_pod_sandbox() == []
        client.remove_image(image)
        assert client.list_images() == []


def test_a_runtime_error_names_the_rpc_its_status_and_the_runtimes_message(runtime):
    _, sock = runtime
    with CRIClient(sock, timeout=5) as client, pytest.raises(CRIError) as caught:
        client.container_status("nope")
    e = caught.value
    assert isinstance(e, RuntimeBackendError)
    assert e.code == "NOT_FOUND" and e.details["rpc"] == "ContainerStatus"
    assert str(e).startswith(
        'CRI ContainerStatus failed (NOT_FOUND): an error occurred when try to find container "nope"'
    )
    assert isinstance(e.__cause__, grpc.RpcError)
    # it crosses an agent's wire as itself
    back = PodmigrateError.from_wire(e.to_wire())
    assert isinstance(back, CRIError) and back.code == "NOT_FOUND"


def test_a_missing_socket_says_the_runtime_is_not_answering_and_what_to_do(tmp_path):
    sock = tmp_path / "containerd.sock"
    with CRIClient(sock, timeout=5) as client, pytest.raises(CRIError) as caught:
        client.version()
    e = caught.value
    assert e.code == "UNAVAILABLE" and "CRI Version failed (UNAVAILABLE)" in e.message
    assert e.hint is not None and str(sock) in e.hint and "containerd" in e.hint


def test_the_committed_stubs_are_what_the_pinned_proto_generates(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(
        [str(ROOT / "scripts" / "gen-cri"), str(tmp_path)], env=env, capture_output=True, text=True, check=False
    )
    assert p.returncode == 0, p.stderr
    stale = [
        name
        for name in STUBS
        if (tmp_path / "podmigrate" / "cri" / name).read_bytes()
        != (ROOT / "src" / "podmigrate" / "cri" / name).read_bytes()
    ]
    assert not stale, f"{stale} differ from src/podmigrate/cri/api.proto: run scripts/gen-cri and commit them"
