"""A simulated Spot interruption of a lab node (``podmigrate lab notice``), and its end.

``post`` puts EC2's instance-action document on the node (its agent serves it, ``agent.notice``) and
starts the node's *terminator*: a process of the lab (in its cgroup: ``lab down`` ends it) that
waits until the notice's time and then does what the cloud would, stopping every container still
running on the node (their service routes go with it), and records what it stopped in
``<lab>/notices/<node>.json``: what had not moved by the deadline. ``engine.watch.notices`` reads every
node's document (what ``podmigrate watch`` polls); ``withdraw`` takes one back before its time.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from podmigrate import procs
from podmigrate.agent.notice import document, parse_time
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.lab.cluster import Lab
from podmigrate.lab.host import join


def _dir(lab: Lab) -> Path:
    d = lab.dir / "notices"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _pidfile(lab: Lab, node: str) -> Path:
    return lab.dir / "pids" / f"terminator-{node}.pid"


def post(lab: Lab, node: str, in_s: float, action: str = "terminate") -> dict[str, Any]:
    """The notice on ``node`` for ``in_s`` seconds from now, and its terminator started."""
    if node not in lab.nodes:
        raise UsageError(
            f"there is no node {node!r} in lab {lab.name!r}", hint=f"its nodes are: {', '.join(lab.nodes)}"
        )
    if not 1 <= in_s <= 3600:
        raise UsageError(f"a notice {in_s} s ahead is out of range", hint="give --in between 1 and 3600 seconds")
    withdraw(lab, node)  # one notice per node: a new one replaces the old
    doc = document(action, time.time() + in_s)
    agent = lab.agent(node)
    try:
        agent.put("/v1/notice", doc)
    finally:
        agent.close()
    (_dir(lab) / f"{node}.json").unlink(missing_ok=True)
    log = open(lab.dir / "logs" / f"terminator-{node}.log", "ab")  # the child's stdout and stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "podmigrate.lab.notice", lab.name, node, doc["time"]],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        preexec_fn=join(lab.cgroup),  # into the lab's cgroup: lab down ends it
        start_new_session=True,  # a Ctrl-C of the command that posted it does not end the node's fate
    )
    log.close()
    procs.write_pidfile(_pidfile(lab, node), proc.pid)
    return {"node": node, "instance_action": doc, "in_s": in_s, "terminator_pid": proc.pid}


def withdraw(lab: Lab, node: str) -> dict[str, str] | None:
    """Take back ``node``'s notice and stop its terminator; the document it had, if any."""
    terminator = procs.read_pidfile(_pidfile(lab, node))  # by pid and start time: pids get reused
    if terminator is not None:
        procs.kill(terminator, signal.SIGTERM)
    _pidfile(lab, node).unlink(missing_ok=True)
    agent = lab.agent(node)
    try:
        was: dict[str, str] | None = agent.delete("/v1/notice")["instance_action"]
    finally:
        agent.close()
    return was


def terminated(lab: Lab, node: str) -> dict[str, Any] | None:
    """What the terminator stopped on ``node`` at its deadline, once it has."""
    try:
        data: dict[str, Any] = json.loads((_dir(lab) / f"{node}.json").read_text())
    except (OSError, ValueError):
        return None
    return data


def terminate(lab: Lab, node: str, at: float) -> dict[str, Any]:
    """At ``at``, stop every container running on ``node``, as the cloud ends the instance."""
    while (left := at - time.time()) > 0:
        time.sleep(min(left, 0.5))
    agent = lab.agent(node, timeout=60)
    stopped, failed, addresses = [], {}, []
    try:
        for c in agent.get("/v1/containers"):
            if c["state"] != "running":
                continue
            try:
                agent.post(f"/v1/containers/{c['name']}/stop", {"timeout": 1})
                stopped.append(c["name"])
                addresses += c["ips"]
            except PodmigrateError as e:
                failed[c["name"]] = e.message
    finally:
        agent.close()
    lan = lab.agent("lan")
    try:  # the node is gone: its services' routes lead nowhere (the LAN forgets them)
        for ip in addresses:
            with contextlib.suppress(PodmigrateError):
                lan.delete(f"/v1/routes/{ip}")
    finally:
        lan.close()
    result = {"node": node, "terminated_at": time.time(), "deadline": at, "stopped": stopped, "failed": failed,
              "routes_removed": addresses}  # fmt: skip
    path = _dir(lab) / f"{node}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str]) -> None:
    name, node, when = argv
    lab = Lab(name)
    print(json.dumps(terminate(lab, node, parse_time(when))), flush=True)
    _pidfile(lab, node).unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1:])
