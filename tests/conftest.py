"""Shared fixtures. Tests marked ``lab`` run against real labs (root, CRIU, Podman) whose names are this
test run's own (``RUN``, e.g. ``pm3fa2c1``, and ``RUN-SUFFIX`` for the others), so that test runs, a
demo and benchmarks can share the machine; each is started once and removed at the end
(PODMIGRATE_KEEP_LAB=1 keeps them; PODMIGRATE_TEST_LAB=NAME uses that lab instead of the session's own,
left up if it was up; PODMIGRATE_TEST_KUBE_LAB=NAME the same for the Kubernetes tests' lab). A run that
died without its teardown is found by the next one: each lab a run starts is listed in
``$PODMIGRATE_HOME/test-runs`` with the run's process, and labs whose run is gone are taken down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
RUN = f"pm{uuid.uuid4().hex[:6]}"
LAB_NAME = os.environ.get("PODMIGRATE_TEST_LAB") or RUN


def run_lab_name(suffix: str) -> str:
    """A lab name of this test run's own."""
    return f"{RUN}-{suffix}"[:20]


def _runs_dir() -> Path:
    from podmigrate.lab.host import home

    return home() / "test-runs"


def own(name: str) -> None:
    """Record that this test run owns lab ``name`` (before it comes up: a run killed while it starts
    leaves nothing unlisted)."""
    from podmigrate import procs

    d = _runs_dir()
    d.mkdir(parents=True, exist_ok=True)
    procs.write_pidfile(d / name, os.getpid())


def disown(name: str) -> None:
    (_runs_dir() / name).unlink(missing_ok=True)


def take_down_orphans() -> None:
    """Labs of test runs that died without their teardown: their run's process is gone."""
    from podmigrate import procs
    from podmigrate.lab.cluster import Lab

    d = _runs_dir()
    for f in sorted(d.iterdir()) if d.is_dir() else []:
        if procs.read_pidfile(f) is None:
            with contextlib.suppress(Exception):
                Lab(f.name).down()
            f.unlink(missing_ok=True)


def wait_for(pred: Callable[[], T | None], timeout: float, what: str, step: float = 0.1) -> T:
    """Poll ``pred`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


def hold_connection(lan: Any, host: str, port: int = 8000) -> str:
    """Open a keep-alive client connection from the LAN (the agent polls it every 50 ms) and wait
    until it has carried a few requests; its id."""
    conn: dict[str, Any] = lan.post("/v1/connections", {"host": host, "port": port, "interval": 0.05})
    wait_for(lambda: lan.get(f"/v1/connections/{conn['id']}")["requests"] >= 5, 10, "requests before")
    return str(conn["id"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="lab tests need root")
        for item in items:
            if "lab" in item.keywords:
                item.add_marker(skip)


def _terminated(*_: object) -> None:
    raise KeyboardInterrupt("SIGTERM")  # pytest then runs the teardowns: the run's labs go down


@pytest.fixture(scope="session", autouse=True)
def _session_cleanup() -> Iterator[None]:
    if os.geteuid() == 0:
        take_down_orphans()
    old = signal.signal(signal.SIGTERM, _terminated)
    yield
    signal.signal(signal.SIGTERM, old)


def up_lab(name: str, **kw: Any) -> Iterator[Any]:
    """A lab of this test run, up with the workload image, taken down at the end; a lab that was up
    already (PODMIGRATE_TEST_LAB) is used and left up."""
    from podmigrate.lab.cluster import Lab
    from podmigrate.workload.image import ready_lab

    the_lab = Lab(name)
    ours = not the_lab.is_up()
    if ours:
        own(name)
    try:
        # with the workload image: some tests run it with plain podman, not through manage.start
        ready_lab(the_lab, nodes=2, report=lambda m: print(f"[lab {name}] {m}", flush=True), **kw)
        yield the_lab
    finally:
        if ours and os.environ.get("PODMIGRATE_KEEP_LAB") != "1":
            the_lab.down()
            disown(name)


@pytest.fixture(scope="session")
def lab() -> Iterator[Any]:
    yield from up_lab(LAB_NAME)


@pytest.fixture(scope="session")
def containerd_lab() -> Iterator[Any]:
    """A lab whose nodes run containerd beside podman (the CRI and Kubernetes tests, and the
    two-lab test's first lab)."""
    yield from up_lab(run_lab_name("cri"), runtime="containerd")


KERNEL_BEFORE_KUBE: dict[str, int] = {}  # the machine's settings the kubelet would write, before it ran


@pytest.fixture(scope="session")
def kube() -> Iterator[Any]:
    """Upstream Kubernetes (``podmigrate kube up``) on a containerd lab of its own: its kubelets own
    their nodes' containerd, which the CRI tests (``containerd_lab``) drive themselves."""
    from podmigrate.kube.cluster import KubeCluster
    from podmigrate.kube.kubelet import KERNEL_DEFAULTS

    given = os.environ.get("PODMIGRATE_TEST_KUBE_LAB")  # a lab with its cluster up, left as it is
    for the_lab in up_lab(given or run_lab_name("kube"), runtime="containerd"):
        KERNEL_BEFORE_KUBE.update({k: int(Path("/proc/sys", k).read_text()) for k in KERNEL_DEFAULTS})
        cluster = KubeCluster(the_lab)
        cluster.up(lambda m: print(f"[kube] {m}", flush=True))
        try:
            yield cluster
        finally:
            if not given:
                cluster.down()


@pytest.fixture(scope="session")
def installed(kube: Any) -> Any:
    """``kube`` with podmigrate installed as a user installs it (``kube install``)."""
    from podmigrate.errors import PodmigrateError
    from podmigrate.kube import install

    try:
        install.install(kube, lambda m: print(f"[install] {m}", flush=True))
    except PodmigrateError as e:  # its details (the pods, events, logs) are the diagnosis
        raise AssertionError(f"{e}\n{json.dumps(e.details, indent=1)}") from e
    return kube


@pytest.fixture
def example(installed: Any) -> Iterator[dict[str, Any]]:
    """The user's example (64 MB heap) running on ``installed``; its state. Removed with every
    migration, evacuation and cordon after."""
    from podmigrate.kube import install

    from .kube_helpers import NS, nodes_settled, serving

    wait_for(lambda: nodes_settled(installed), 180, "every node Ready, schedulable and untainted")
    install.apply_example(installed, NS, heap_mb=64)
    _pod, st = serving(installed)
    yield st
    installed.kubectl(["delete", "plm", "--all", "-n", NS, "--wait=true", "--timeout=120s"], check=False)
    installed.kubectl(["delete", "nev", "--all", "--wait=true", "--timeout=120s"], check=False)
    # the heap server has nothing to flush: no 30 s grace period per test
    gone = ["delete", "pods", "-n", NS, "-l", "app=heapsrv", "--grace-period=1", "--wait=true", "--timeout=120s"]
    installed.kubectl(gone, check=False)
    for node in installed.lab.nodes:
        installed.kubectl(["uncordon", node], check=False)
        for key in ("aws-node-termination-handler/spot-itn", "gpu"):  # one call each: a missing one fails the call
            installed.kubectl(["taint", "node", node, f"{key}-"], check=False)


@pytest.fixture
def workload(lab: Any) -> Iterator[Callable[..., dict[str, Any]]]:
    """Start stream-server workloads with unique names; all are removed afterwards."""
    from podmigrate.errors import UsageError
    from podmigrate.workload import manage

    names: list[str] = []

    def start(node: str = "node-a", heap_mb: int = 64, **kw: Any) -> dict[str, Any]:
        name = f"w{uuid.uuid4().hex[:6]}"
        names.append(name)
        return manage.start(lab, name, node, heap_mb, **kw)

    yield start
    for n in names:
        with contextlib.suppress(UsageError):
            manage.stop(lab, n)
