"""What an evacuation starts from: the node's workloads, the targets' room, this lab's past evacuations.

Every agent question here is asked at once where the answers do not depend on each other: each takes
25-100 ms on this machine (a podman command behind most), and the deadline's clock is already running
(``engine.evacuate``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from podmigrate.engine import rates as rates_mod
from podmigrate.engine.cluster import Cluster
from podmigrate.engine.schedule import Factor, Rate, Target, Workload
from podmigrate.errors import PodmigrateError, UsageError


def survey(lab: Cluster, node: str) -> list[Workload]:
    """The running workloads on ``node``: each container, each pod once (by its first member)."""
    if node not in lab.nodes:
        raise UsageError(
            f"there is no node {node!r} in lab {lab.name!r}", hint=f"its nodes are: {', '.join(lab.nodes)}"
        )
    agent = lab.agent(node)
    try:
        running = [c for c in agent.get("/v1/containers") if c["state"] == "running"]
        with ThreadPoolExecutor(4, "survey") as pool:
            pod_f = {p: pool.submit(agent.get, f"/v1/pods/{p}") for p in {c["pod"] for c in running if c["pod"]}}
            alone = sorted(c["name"] for c in running if not c["pod"])
            mem_f = {n: pool.submit(agent.get, f"/v1/containers/{n}/memory") for n in alone}
            pods = {p: f.result() for p, f in pod_f.items()}
            members = [m for p in pods.values() for m in p["members"]]
            mem_f |= {n: pool.submit(agent.get, f"/v1/containers/{n}/memory") for n in members}
            mem = {n: int(f.result()["rss_bytes"]) for n, f in mem_f.items()}
    finally:
        agent.close()
    out = [Workload(n, mem[n], source=node) for n in alone]
    for pod in sorted(pods.values(), key=lambda p: p["name"]):
        if pod["members"]:  # a pod of its infra alone has nothing to move
            out.append(Workload(pod["members"][0], sum(mem[m] for m in pod["members"]), "pod", pod["name"], node))
    return out


def _target(lab: Cluster, node: str) -> Target | str:
    try:
        agent = lab.agent(node, timeout=10)
        try:
            info = agent.get("/v1/info")
        finally:
            agent.close()
    except PodmigrateError as e:
        return e.message
    return Target(node, int(info.get("mem_available_bytes") or 0), int(info.get("disk_free_bytes") or 0))


def targets(lab: Cluster, names: list[str]) -> tuple[list[Target], dict[str, str]]:
    """Free memory and disk of each node in ``names`` that answers; the others with why not."""
    with ThreadPoolExecutor(max(1, min(8, len(names))), "targets") as pool:
        got = list(pool.map(lambda n: _target(lab, n), names))
    found = [t for t in got if isinstance(t, Target)]
    down = {n: t for n, t in zip(names, got, strict=True) if isinstance(t, str)}
    return found, down


def records_dir(lab: Cluster) -> Path:
    d = lab.dir / "evacuations"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def slowdowns(lab: Cluster, rates: dict[str, Rate]) -> tuple[dict[int, Factor], str]:
    """How much slower several migrations at once were, from this lab's past evacuations."""
    return rates_mod.slowdowns(sorted(records_dir(lab).glob("ev-*.json")), rates)


@contextmanager
def exclusive(lab: Cluster, node: str) -> Iterator[None]:
    """One evacuation of a node at a time, across processes (the lock goes with the process)."""
    path = records_dir(lab) / f"{node}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"{node} is already being evacuated (pid {os.pread(fd, 16, 0).decode().strip() or '?'})",
                hint="wait for it to finish; it cordoned the node already",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
