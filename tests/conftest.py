"""Shared fixtures. Tests marked ``lab`` run against a real lab named ``pmtest`` (root, CRIU, Podman);
the lab is started once per session and removed at the end (PODMIGRATE_KEEP_LAB=1 keeps it); a lab
that was up before the session is used and left up."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
LAB_NAME = "pmtest"


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


@pytest.fixture(scope="session")
def lab() -> Iterator[Any]:
    from podmigrate.lab.cluster import Lab
    from podmigrate.workload.image import ready_lab

    the_lab = Lab(LAB_NAME)
    # a lab that was up already is someone else's (a CI run, a benchmark): used, never taken down
    ours = not the_lab.is_up()
    # with the workload image: some tests run it with plain podman, not through manage.start
    ready_lab(the_lab, nodes=2, report=lambda m: print(f"[lab] {m}", flush=True))
    yield the_lab
    if ours and os.environ.get("PODMIGRATE_KEEP_LAB") != "1":
        the_lab.down()


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
