"""``CRIClient``: the CRI v1 RuntimeService and ImageService over a runtime's Unix socket.

Role: the one place that speaks gRPC to a container runtime (containerd's CRI socket), for the
test kubelet and the Kubernetes node agent. Methods take simple arguments where that is all a
caller needs (ids, an image name, a checkpoint path) and the generated messages (``api_pb2``)
where the runtime wants the full picture (``ContainerConfig``, ``PodSandboxConfig``); they return
the runtime's messages, typed by the generated ``.pyi``.

Every gRPC failure leaves as ``errors.CRIError`` naming the RPC, the gRPC status and the runtime's
own message, with the ``grpc.RpcError`` chained; ``CRIError.code`` is the status name, so a caller
can treat NOT_FOUND on removal as done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import grpc

from podmigrate.cri import api_pb2 as cri
from podmigrate.cri import api_pb2_grpc as cri_grpc
from podmigrate.errors import CRIError

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

# The kubelet's own limit (16 MiB, pkg/kubelet/cri/remote): a node with many containers or images
# answers List* with more than gRPC's default 4 MiB.
_MAX_MESSAGE = 16 * 1024 * 1024

# The CRI version this client speaks, sent in VersionRequest (the proto it was generated from).
CRI_API_VERSION = "v1"


class CRIClient:
    """A connection to one runtime's CRI socket; use as a context manager, or ``close()`` it.

    ``timeout`` is each call's gRPC deadline in seconds. Calls that carry their own time limit to
    the runtime (stop's grace period, checkpoint, exec) get that much longer, so the runtime's limit
    is what fires, not ours.
    """

    def __init__(self, socket_path: Path, timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        # unix:///abs/path: gRPC's form for an absolute socket path (unix:rel is relative to cwd)
        self._channel = grpc.insecure_channel(
            f"unix://{Path(socket_path).absolute()}",
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE)],
        )
        self._runtime = cri_grpc.RuntimeServiceStub(self._channel)
        self._images = cri_grpc.ImageServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CRIClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- runtime --------------------------------------------------------------------------------

    def version(self) -> cri.VersionResponse:
        """The runtime's name and version and the CRI version it speaks (``runtime_api_version``)."""
        return self._call("Version", self._runtime.Version, cri.VersionRequest(version=CRI_API_VERSION))

    def status(self, verbose: bool = False) -> cri.StatusResponse:
        """Runtime conditions (RuntimeReady, NetworkReady) and its runtime handlers (RuntimeClasses)."""
        return self._call("Status", self._runtime.Status, cri.StatusRequest(verbose=verbose))

    # -- pod sandboxes --------------------------------------------------------------------------

    def run_pod_sandbox(self, config: cri.PodSandboxConfig, runtime_handler: str = "") -> str:
        """Create and start a pod sandbox; returns its id. ``runtime_handler`` picks a RuntimeClass."""
        request = cri.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
        return self._call("RunPodSandbox", self._runtime.RunPodSandbox, request).pod_sandbox_id

    def stop_pod_sandbox(self, pod_id: str) -> None:
        """Stop the sandbox and every container in it (idempotent in the runtime)."""
        self._call("StopPodSandbox", self._runtime.StopPodSandbox, cri.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod_sandbox(self, pod_id: str) -> None:
        """Remove the sandbox and its containers (idempotent in the runtime)."""
        request = cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id)
        self._call("RemovePodSandbox", self._runtime.RemovePodSandbox, request)

    def pod_sandbox_status(self, pod_id: str, verbose: bool = False) -> cri.PodSandboxStatusResponse:
        """``.status`` has the state and ``network.ip``; ``verbose`` adds the runtime's ``info``."""
        request = cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose)
        return self._call("PodSandboxStatus", self._runtime.PodSandboxStatus, request)

    def list_pod_sandbox(self, labels: Mapping[str, str] | None = None) -> list[cri.PodSandbox]:
        """Sandboxes whose labels include ``labels`` (all when None)."""
        request = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector=dict(labels or {})))
        return list(self._call("ListPodSandbox", self._runtime.ListPodSandbox, request).items)

    # -- images ---------------------------------------------------------------------------------

    def pull_image(
        self,
        image: str,
        *,
        auth: cri.AuthConfig | None = None,
        sandbox_config: cri.PodSandboxConfig | None = None,
        timeout: float | None = None,
    ) -> str:
        """Pull ``image`` into the runtime's store; returns its reference (``name@sha256:...``).

        ``timeout`` (seconds, default the client's) bounds the whole pull: large images need more.
        """
        request = cri.PullImageRequest(image=cri.ImageSpec(image=image), auth=auth, sandbox_config=sandbox_config)
        return self._call("PullImage", self._images.PullImage, request, timeout).image_ref

    def image_status(self, image: str) -> cri.Image | None:
        """The image as the runtime knows it, or None if it does not have it (not an error in CRI)."""
        response = self._call(
            "ImageStatus", self._images.ImageStatus, cri.ImageStatusRequest(image=cri.ImageSpec(image=image))
        )
        return response.image if response.HasField("image") else None

    def list_images(self) -> list[cri.Image]:
        return list(self._call("ListImages", self._images.ListImages, cri.ListImagesRequest()).images)

    def remove_image(self, image: str) -> None:
        """Remove the image (idempotent in the runtime)."""
        self._call("RemoveImage", self._images.RemoveImage, cri.RemoveImageRequest(image=cri.ImageSpec(image=image)))

    # -- containers -----------------------------------------------------------------------------

    def create_container(self, pod_id: str, config: cri.ContainerConfig, sandbox_config: cri.PodSandboxConfig) -> str:
        """Create a container in the sandbox; returns its id.

        containerd 2.1-2.3 restore a checkpoint here when ``config.image.image`` names a checkpoint
        archive on the node or a checkpoint image (the restore then happens in ``start_container``).
        """
        request = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=config, sandbox_config=sandbox_config)
        return self._call("CreateContainer", self._runtime.CreateContainer, request).container_id

    def start_container(self, container_id: str) -> None:
        request = cri.StartContainerRequest(container_id=container_id)
        self._call("StartContainer", self._runtime.StartContainer, request)

    def stop_container(self, container_id: str, grace: int = 0) -> None:
        """Stop the container, killing it after ``grace`` seconds (0: at once)."""
        request = cri.StopContainerRequest(container_id=container_id, timeout=grace)
        self._call("StopContainer", self._runtime.StopContainer, request, self.timeout + grace)

    def remove_container(self, container_id: str) -> None:
        """Remove the container, forcibly if it runs (idempotent in the runtime)."""
        request = cri.RemoveContainerRequest(container_id=container_id)
        self._call("RemoveContainer", self._runtime.RemoveContainer, request)

    def container_status(self, container_id: str, verbose: bool = False) -> cri.ContainerStatusResponse:
        """``.status`` has the state, exit code, image ref and annotations; ``verbose`` adds ``info``."""
        request = cri.ContainerStatusRequest(container_id=container_id, verbose=verbose)
        return self._call("ContainerStatus", self._runtime.ContainerStatus, request)

    def list_containers(self, pod_id: str = "", labels: Mapping[str, str] | None = None) -> list[cri.Container]:
        """Containers of the sandbox ``pod_id`` (all when empty) whose labels include ``labels``."""
        filter_ = cri.ContainerFilter(pod_sandbox_id=pod_id, label_selector=dict(labels or {}))
        request = cri.ListContainersRequest(filter=filter_)
        return list(self._call("ListContainers", self._runtime.ListContainers, request).containers)

    def checkpoint_container(self, container_id: str, location: str | PathLike[str], timeout: int = 120) -> None:
        """Checkpoint the container into the archive ``location`` (a path on the runtime's node).

        ``timeout`` is the runtime's limit in seconds (0: its default). containerd leaves the
        container running.
        """
        request = cri.CheckpointContainerRequest(container_id=container_id, location=str(location), timeout=timeout)
        self._call("CheckpointContainer", self._runtime.CheckpointContainer, request, self.timeout + timeout)

    def exec_sync(self, container_id: str, cmd: Sequence[str], timeout: int = 10) -> cri.ExecSyncResponse:
        """Run ``cmd`` in the container; ``.exit_code``, ``.stdout``, ``.stderr`` (bytes).

        A command that exits non-zero is a response, not an error; ``timeout`` (seconds, 0: none)
        is the runtime's limit for the command.
        """
        request = cri.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout)
        return self._call("ExecSync", self._runtime.ExecSync, request, self.timeout + timeout)

    # -- the boundary ---------------------------------------------------------------------------

    def _call(
        self,
        rpc: str,
        method: grpc.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
        timeout: float | None = None,
    ) -> _Resp:
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise _cri_error(rpc, e, self.socket_path) from e


def _cri_error(rpc: str, error: grpc.RpcError, socket_path: Path) -> CRIError:
    # Errors raised by a call are also grpc.Call (code, details); anything else has neither.
    if isinstance(error, grpc.Call):
        code, message = error.code(), error.details() or ""
    else:
        code, message = grpc.StatusCode.UNKNOWN, str(error)
    hint = None
    if code is grpc.StatusCode.UNAVAILABLE:
        hint = (
            f"nothing answers on the CRI socket {socket_path}: is the runtime (containerd) running on that"
            " node, with its CRI plugin loaded? Its log says why not; start it and retry"
        )
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        hint = "the runtime did not answer in time; it may still be working: check its state before retrying"
    elif code is grpc.StatusCode.UNIMPLEMENTED:
        hint = f"this runtime does not implement CRI {rpc} (check its version and config)"
    return CRIError(
        f"CRI {rpc} failed ({code.name}): {message}",
        hint=hint,
        details={"rpc": rpc, "code": code.name, "socket": str(socket_path)},
    )
