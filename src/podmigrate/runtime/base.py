"""The runtime interface a node agent talks to: the ``Runtime`` protocol and the records it passes.

``podman.Podman`` is the lab's implementation (mypy checks that it conforms, in ``podman``);
``tests/test_runtime_protocol.py`` checks that the agent calls nothing the protocol leaves out.
Standard library only.
"""

from __future__ import annotations

import subprocess
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from podmigrate.runtime.criu_conf import CriuRun
    from podmigrate.runtime.speculative import Gate
    from podmigrate.runtime.uffd import FaultWaker


class ContainerInfo(TypedDict):
    name: str
    id: str
    state: str  # running, exited, created, paused, ...
    image: str
    image_id: str  # what a restore needs on the target: this very image, not one of the same name
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
    mounts: list[dict[str, str]]  # type, source, destination (bind mounts and volumes)
    devices: list[str]  # host device paths
    ports: list[str]  # published ports ("8080/tcp")


class NodeCapabilities(TypedDict):
    """What a node's runtime can do, as far as choosing a migration goes (in GET /v1/info)."""

    runtime: str  # which backend the agent drives ("podman"): how to read the rest of its answers
    criu: str  # CRIU's version ("missing" without one): socket dumps on kernels >= 6.16 need 4.2
    lazy_dump_read: bool  # CRIU can leave a lazy dump's pages in the frozen tasks (lab.criu_build's patch)
    lazy_pages: bool  # userfaultfd can be opened: a post-copy (lazy) restore faults its memory in through it
    page_server: bool  # CRIU can run a page server: a streamed dump sends its pages straight to the target
    soft_dirty: bool  # the kernel tracks dirtied pages: an iterative pre-copy (pre-dump) needs it
    pods: bool  # whole pods dump and restore under one network lock: a pod migration needs it
    tcp_established: bool  # open TCP connections survive the dump: a live migration keeps its clients


class Runtime(Protocol):
    """The verbs a node agent needs; each raises ``RuntimeBackendError`` with the runtime's own output on failure."""

    # ---- the node
    def info(self) -> dict[str, Any]: ...  # versions, ``capabilities()`` flattened, and ``capabilities``
    def capabilities(self) -> NodeCapabilities: ...  # what migrations this node can take part in
    def criu_options(  # CRIU options for the block (``criu_conf``)
        self, *lines: str, run: CriuRun | None = None, container_id: str | None = None
    ) -> AbstractContextManager[Path]: ...
    def cpuinfo(self) -> str | None: ...  # this CPU as CRIU records it (base64 cpuinfo.img)
    def cpuinfo_check(self, image: str) -> str | None: ...  # None: dumps from that CPU run here
    def ensure_image(self, image: str, image_id: str = "") -> dict[str, Any]: ...  # present/pulled/why
    def save_image(self, image_id: str, archive: Path) -> None: ...  # an OCI archive of the image
    def load_image(self, archive: Path, image_id: str, name: str) -> None: ...  # the same image here, or error

    # ---- containers
    def list_containers(self) -> list[ContainerInfo]: ...  # every container, running or not
    def inspect(self, name: str) -> ContainerInfo: ...  # one container
    def run(self, spec: RunSpec) -> ContainerInfo: ...  # start a new container
    def spec(self, name: str) -> dict[str, Any]: ...  # how to start it afresh (cold baseline)
    def rss(self, name: str) -> int: ...  # resident bytes of its processes (what a restore writes)
    def stop(self, name: str, timeout: float = 2) -> None: ...  # stop, killing after ``timeout`` s
    def start(self, name: str) -> None: ...  # start a stopped container again
    def rename(self, name: str, new: str) -> None: ...  # running or not
    def remove(self, name: str) -> None: ...  # container or pod, force
    def retire(self, name: str, ips: list[str]) -> dict[str, Any]: ...  # isolate, then remove

    # ---- checkpoint and restore (stats: CRIU's, with start and end times)
    def checkpoint(
        self,
        name: str,
        archive: Path,
        *,
        tcp_established: bool = True,
        leave_running: bool = False,
        criu: tuple[str, ...] = (),
    ) -> dict[str, Any]: ...  # dump into ``archive``, ``criu`` options added (page server, leave-stopped)
    def restore_local(
        self, name: str, *, tcp_established: bool = True
    ) -> dict[str, Any]: ...  # restore in place from the runtime's own copy (rollback)
    def restore_archive(
        self, archive: Path, *, tcp_established: bool = True, criu: tuple[str, ...] = (), network: str = "keep"
    ) -> dict[str, Any]: ...  # restore a copy from an archive (``network``: ``podman_cli.restore_network``)
    def resume(self, name: str) -> dict[str, Any]: ...  # wake a container a dump left stopped
    def withdraw(self, address: str) -> dict[str, Any]: ...  # its L2 interface down (``runtime.l2``)
    def announce(self, address: str) -> dict[str, Any]: ...  # its L2 interface up, gratuitous ARP

    # ---- whole pods
    def create_pod(
        self, name: str, network: str, ip: str | None = None, mac: str | None = None
    ) -> None: ...  # an empty pod, with a given address if any
    def pod_info(self, pod: str) -> dict[str, Any]: ...  # name, infra container, members, MAC
    def pod_lock(self, pod: str, on: bool) -> None: ...  # drop every packet in its network namespace, or stop
    def checkpoint_pod(
        self, pod: str, archives: dict[str, Path], *, tcp_established: bool = True, leave_running: bool = False
    ) -> dict[str, Any]: ...  # dump every member under one network lock
    def restore_pod_in_place(
        self, pod: str, members: list[str], *, tcp_established: bool = True
    ) -> dict[str, Any]: ...  # rollback of checkpoint_pod
    def restore_pod(
        self,
        pod: str,
        network: str,
        ip: str,
        archives: dict[str, Path],
        *,
        mac: str | None = None,
        tcp_established: bool = True,
        fresh: list[RunSpec] | None = None,
    ) -> dict[str, Any]: ...  # recreate the pod and restore its members into it

    # ---- streamed and post-copy memory (the processes returned run on after the call)
    # ``tls``: CRIU's TLS options as runc.conf lines (``tls``, ``tls-cacert=...``), empty for none
    def page_server(
        self, images: Path, address: str, port: int, *, tls: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]: ...  # receive a dump's pages into ``images``
    def skeleton(self, name: str) -> dict[str, Any]: ...  # what a speculative restore needs, before the freeze
    def huge_pages(self, name: str) -> dict[str, Any]: ...  # a restored copy's memory back in huge pages
    def speculate(
        self, token: str, skeleton: dict[str, Any], where: Path, *, tcp_established: bool = True
    ) -> Gate: ...  # a restore of ``skeleton`` that waits at gate ``token`` for the real images
    def lazy_checkpoint(
        self,
        name: str,
        archive: Path,
        address: str,
        port: int,
        *,
        tcp_established: bool = True,
        tls: tuple[str, ...] = (),
        criu: tuple[str, ...] = (),
    ) -> tuple[subprocess.Popen[str], dict[str, Any]]: ...  # dump all but memory, then serve the pages
    def lazy_restore(
        self,
        archive: Path,
        images: Path,
        work: Path,
        address: str | None,
        port: int | None,
        *,
        tcp_established: bool = True,
        wake_faults: bool = True,
        tls: tuple[str, ...] = (),
        action_script: str | None = None,
        gate: Gate | None = None,
        network: str = "keep",
    ) -> tuple[
        dict[str, Any], subprocess.Popen[bytes], FaultWaker | None
    ]: ...  # restore, pages on fault (from ``images`` without an address); CRIU runs ``action_script``
