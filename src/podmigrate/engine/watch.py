"""``podmigrate watch``: turn each Spot interruption notice into an evacuation with its deadline.

What aws-node-termination-handler does on a node, done by the lab's controller for every node: poll
each node's instance-action document (its agent's ``/v1/notice``), and for one not handled yet evacuate the node
(``engine.evacuate``) with the seconds left until its time. A notice is handled once (its time is
written to ``<lab>/notices/<node>.handled``); a new notice on the same node is a new one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from podmigrate.agent.notice import parse_time
from podmigrate.engine.cluster import Cluster
from podmigrate.engine.evacuate import Evacuation
from podmigrate.engine.phases import Report
from podmigrate.errors import PodmigrateError

Evacuate = Callable[[str, float], dict[str, Any]]  # (node, deadline seconds) -> evacuation record


def _handled(lab: Cluster, node: str) -> str | None:
    try:
        return (lab.dir / "notices" / f"{node}.handled").read_text().strip()
    except OSError:
        return None


def pending(lab: Cluster, nodes: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Notices not handled yet, by node."""
    return {n: d for n, d in notices(lab).items() if (not nodes or n in nodes) and _handled(lab, n) != d["time"]}


def notices(lab: Cluster) -> dict[str, dict[str, Any]]:
    """Each node's instance-action document, with its deadline in epoch seconds (``at``)."""
    out: dict[str, dict[str, Any]] = {}
    for node in lab.nodes:
        agent = lab.agent(node, timeout=10)
        try:
            doc = agent.get("/v1/notice")["instance_action"]
        except PodmigrateError:
            continue  # a node whose agent does not answer has no notice to give
        finally:
            agent.close()
        if doc:
            out[node] = {**doc, "at": parse_time(doc["time"])}
    return out


def handle(lab: Cluster, node: str, doc: dict[str, Any], evacuate: Evacuate, report: Report) -> dict[str, Any]:
    """Evacuate ``node`` by ``doc``'s deadline; the evacuation's record (with the notice)."""
    (lab.dir / "notices").mkdir(mode=0o700, exist_ok=True)
    (lab.dir / "notices" / f"{node}.handled").write_text(doc["time"] + "\n")
    left = doc["at"] - time.time()
    report(f"{node}: instance-action {doc['action']} at {doc['time']}, {left:.1f} s from now")
    if left < 1:
        return {"node": node, "instance_action": doc, "empty": False, "why": f"the notice came {-left:.1f} s too late"}
    return {**evacuate(node, left), "instance_action": doc}


def watch(
    lab: Cluster,
    evacuate: Evacuate | None = None,
    nodes: list[str] | None = None,
    once: bool = False,
    interval: float = 1.0,
    report: Report = lambda _m: None,
) -> list[dict[str, Any]]:
    """Poll until stopped (``once``: until the notices there are now are handled); the records."""
    run = evacuate or (lambda node, left: Evacuation(lab, node, left, report=report).run())
    done: list[dict[str, Any]] = []
    while True:
        for node, doc in sorted(pending(lab, nodes).items(), key=lambda nd: nd[1]["at"]):  # soonest first
            done.append(handle(lab, node, doc, run, report))
        if once:
            return done
        time.sleep(interval)
