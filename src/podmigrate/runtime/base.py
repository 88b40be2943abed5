"""The runtime interface a node agent talks to (standard library only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, TypedDict


class ContainerInfo(TypedDict):
    name: str
    id: str
    state: str  # running, exited, created, paused, ...
    image: str
    ips: list[str]
    pod: str | None
    labels: dict[str, str]


class RunSpec(TypedDict, total=False):
    name: str
    image: str
    command: list[str]
    entrypoint: list[str]
    env: dict[str, str]
    labels: dict[str, str]
    network: str
    ip: str
    pod: str


class Runtime(Protocol):
    """The verbs a node agent needs; each raises ``RuntimeBackendError`` with the runtime's own output on failure."""

    def info(self) -> dict[str, Any]: ...  # versions and capabilities
    def list_containers(self) -> list[ContainerInfo]: ...
    def run(self, spec: RunSpec) -> ContainerInfo: ...
    def create_pod(self, name: str, network: str) -> None: ...
    def remove(self, name: str) -> None: ...  # container or pod, force
    def checkpoint(
        self, name: str, archive: Path, *, tcp_established: bool, leave_running: bool
    ) -> dict[str, Any]: ...  # -> CRIU statistics
    def restore_local(self, name: str, *, tcp_established: bool) -> dict[str, Any]: ...
    def restore_archive(self, archive: Path, *, tcp_established: bool) -> dict[str, Any]: ...
    def ensure_image(self, image: str) -> bool: ...  # True when it had to pull
    def spec(self, name: str) -> dict[str, Any]: ...  # how to start it afresh (cold baseline)
    def stop(self, name: str, timeout: float) -> None: ...
    def start(self, name: str) -> None: ...
    def retire(self, name: str, ips: list[str]) -> dict[str, Any]: ...  # isolate, then remove
