"""Podman's own paths, timed beside the engine's: its registry path and its export/import on one node.

Probed like the engine's migrations (the LAN agent's 50 Hz prober on the service address) and checked
like them: the heap's SHA-256, the counter and the process start read before and after. The one-node
export/import is the baseline issue 14 names ("Podman's checkpoint --export + restore --import on one
node"), with Podman's defaults (zstd); its ``--print-stats`` give the time runc and CRIU took inside
it (``runtime_s``, recorded only: it is no bound on a streamed path, which beat it on 2026-12-04).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

from podmigrate import layout
from podmigrate.engine import breakdown
from podmigrate.engine.blackout import blackout
from podmigrate.engine.phases import traffic
from podmigrate.engine.record import Record
from podmigrate.errors import PodmigrateError
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage


def kept(before: dict[str, Any] | None, after: dict[str, Any] | None) -> tuple[str, bool]:
    """The state check every migration makes: same heap, same process, the counter not backwards."""
    if not before or not after:
        return "unknown", False
    checks = traffic.state_checks(before, after)
    return ("kept" if all(checks.values()) else "lost"), checks["sha256_equal"]


def _answered(lan: Any, probe: str, since: float, seconds: float = 120.0) -> None:
    """Until the prober has 3 answers sent after ``since`` (as ``traffic.finish_probe`` waits), so
    that its log holds the copy's first answer before it is stopped."""
    deadline = time.monotonic() + seconds
    while sum(1 for r in lan.get(f"/v1/probes/{probe}") if r["ok"] and r["sent"] > since) < 3:
        if time.monotonic() > deadline:
            raise PodmigrateError(f"the workload did not answer its prober within {seconds:.0f} s of its restore")
        time.sleep(0.02)


def _begin(lab: Lab, name: str) -> tuple[str, dict[str, Any] | None, Any, str, dict[str, float]]:
    """The workload's address and state, a prober on it that has had an answer (the blackout starts
    from a serving copy), and the start time."""
    ip = manage.locate(lab, name).ips[0]
    before = manage.read_state(lab, ip)
    lan = lab.agent("lan")
    probe = lan.post("/v1/probes", {"host": ip, "port": 8000, "path": "/healthz"})["id"]
    deadline = time.monotonic() + 10
    while not any(r["ok"] for r in lan.get(f"/v1/probes/{probe}")) and time.monotonic() < deadline:
        time.sleep(0.02)
    return ip, before, lan, probe, {"start": time.time()}


def _result(
    source: str, target: str, b: dict[str, Any], t: dict[str, float], names: list[str], state: tuple[str, bool]
) -> dict[str, Any]:
    stamps = [t["start"], *(t[n] for n in names)]
    # the blackout split as the engine's records split theirs (engine.breakdown): each podman command
    # a step, then the wait for the copy's first answer
    timeline = [
        ["LAN: route switch" if n == "cutover" else f"podman: {n}", stamps[i], stamps[i + 1]]
        for i, n in enumerate(names)
    ]
    timeline.append(["after it, until the copy answers", stamps[-1], b.get("first_ok_after") or stamps[-1]])
    return {
        "id": None,
        "source": source,
        "target": target,
        "blackout_s": b["blackout_s"],
        "phase_s": {n: round(stamps[i + 1] - stamps[i], 4) for i, n in enumerate(names)},
        "state": state[0],
        "checks": {"sha256_equal": state[1]},
        "bytes_moved": None,
        "blackout_steps": breakdown.steps(cast(Record, {"blackout": b, "timeline": timeline})),
    }


def podman_image(lab: Lab, name: str, source: str, target: str) -> dict[str, Any]:
    """Podman's own registry path (create-image, push, pull, restore), timed phase by phase."""
    ref = f"{layout.REGISTRY}/podmigrate/bench-image:{name}-{int(time.time())}"
    ip, before, lan, probe, t = _begin(lab, name)
    try:
        lab.run(
            source,
            ["podman", "container", "checkpoint", "--tcp-established", "--create-image", ref, name],
            timeout=1800,
        )
        t["checkpoint"] = time.time()
        lab.run(source, ["podman", "push", "-q", ref], timeout=1800)
        t["push"] = time.time()
        lab.run(target, ["podman", "pull", "-q", ref], timeout=1800)
        t["pull"] = time.time()
        lab.run(target, ["podman", "container", "restore", "--tcp-established", ref], timeout=1800)
        t["restore"] = time.time()
        lan.put(f"/v1/routes/{ip}", {"via": layout.node_ip(target)})
        t["cutover"] = time.time()
        _answered(lan, probe, t["cutover"])
    finally:
        records = lan.delete(f"/v1/probes/{probe}")
        if "restore" in t:
            lab.run(source, ["podman", "rm", "-f", "-t", "0", name], check=False)
            for n in (source, target):
                lab.run(n, ["podman", "rmi", "-f", ref], check=False)
            lab.agent(source).post("/v1/registry/delete", {"reference": ref})
        elif "checkpoint" in t:  # the image is the workload's only copy now: kept, to restore by hand
            print(f"the restore of {name} failed; its checkpoint image is kept: {ref}", flush=True)
        lan.close()
    b = blackout(records, t["start"], time.time())
    state = kept(before, manage.read_state(lab, ip))
    return _result(source, target, b, t, ["checkpoint", "push", "pull", "restore", "cutover"], state)


def _runtime_s(out: str, key: str) -> float | None:
    """The runtime's share (runc + CRIU) from Podman's --print-stats (microseconds), in seconds."""
    try:
        return float((json.loads(out).get("container_statistics") or [{}])[0][key]) / 1e6
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def podman_one_node(lab: Lab, name: str, node: str) -> dict[str, Any]:
    """``podman container checkpoint --export`` and ``podman container restore --import`` where the
    container runs, as a user would: the stopped container is removed in between (its name is
    taken otherwise), the address stays. The archive is owner-only and removed afterwards, unless
    the restore failed after the removal: then it is the workload's only copy, and kept."""
    archive = f"{layout.NODE_CHECKPOINTS}/bench-{name}-{int(time.time() * 1000)}.tar.zst"
    ip, before, lan, probe, t = _begin(lab, name)
    try:
        ck = lab.run(
            node,
            ["sh", "-c", 'umask 077 && exec "$@"', "-", "podman", "container", "checkpoint", "--tcp-established",
             "--print-stats", "--export", archive, name],
            timeout=1800,
        )  # fmt: skip
        t["checkpoint"] = time.time()
        lab.run(node, ["podman", "rm", name])  # exited already: nothing to stop
        t["remove"] = time.time()
        rs = lab.run(
            node,
            ["podman", "container", "restore", "--tcp-established", "--print-stats", "--import", archive],
            timeout=1800,
        )
        t["restore"] = time.time()
        _answered(lan, probe, t["restore"])
    finally:
        records = lan.delete(f"/v1/probes/{probe}")
        if "remove" in t and "restore" not in t:
            print(f"the restore of {name} on {node} failed; its checkpoint is kept in {archive}", flush=True)
        else:
            lab.run(node, ["rm", "-f", archive], check=False)
        lan.close()
    b = blackout(records, t["start"], time.time())
    rec = _result(node, node, b, t, ["checkpoint", "remove", "restore"], kept(before, manage.read_state(lab, ip)))
    dump = _runtime_s(ck.stdout, "runtime_checkpoint_duration")
    back = _runtime_s(rs.stdout, "runtime_restore_duration")
    if dump is not None and back is not None:
        rec["runtime_s"] = round(dump + back, 4)
    return rec
