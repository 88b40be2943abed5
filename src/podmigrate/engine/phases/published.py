"""A workload reached at its host's address and published ports: clusters whose router moves no
address (``Cluster.moves_addresses`` False: hosts with router ``none``).

Its clients reach ``host:port`` (``podman run -p 8080:8000``); after the migration they reach the
target's address on the same port, which the result names (``answers_at``). The copy takes an
address of the target's own network (Podman would reuse the checkpoint's, possibly taken there),
its published ports are re-created by Podman's restore, and open TCP connections are closed, not
carried: nothing would route their packets to the new host. The probe follows the workload: it
probes the source's endpoint until the cutover, then the target's, as a client told of the move.
"""

from __future__ import annotations

import json
import time
from typing import Any

from podmigrate.engine.phases.context import Ctx
from podmigrate.engine.record import ProbeRec
from podmigrate.errors import UsageError

MODES = ("stop-copy", "lazy", "decoupled")  # cold starts afresh from a spec that pins an address


def check(spec: dict[str, Any], name: str, mode: str) -> list[dict[str, Any]]:
    """The container's published ports, refused where they cannot follow it to another host."""
    if mode not in MODES:
        raise UsageError(
            f"mode {mode!r} is not built for clusters whose router moves no address",
            hint=f"use one of: {', '.join(MODES)}",
        )
    published = list(spec.get("published") or [])
    if pinned := [p for p in published if p["host_ip"] not in ("", "0.0.0.0")]:
        shown = ", ".join(f"{p['host_ip']}:{p['host_port']}" for p in pinned)
        raise UsageError(
            f"{name!r} publishes ports on its host's own address ({shown}): the target host has another",
            hint="publish on every address (-p HOSTPORT:PORT, no address) to migrate it",
        )
    return published


def take(ctx: Ctx, published: list[dict[str, Any]]) -> None:
    """validate: what the migration keeps of the source's network, and what it gives up."""
    rec = ctx.rec
    rec["keep_address"] = False
    rec["copy_network"] = "new"
    rec["service_addresses"] = []  # nothing routes to the container itself
    rec["published"] = published
    if rec["plan"]["tcp_established"]:
        rec["plan"]["tcp_established"] = False
        rec["tcp"] = "open connections are closed: the workload's address changes (router none)"


def endpoint(ctx: Ctx, node: str, port: int) -> tuple[str, int]:
    """Where a client reaches the container's ``port`` on ``node``."""
    for p in ctx.rec.get("published") or []:
        if p["container_port"] == port and p["protocol"] == "tcp":
            return ctx.lab.node_address(node), int(p["host_port"])
    raise UsageError(
        f"{ctx.rec['container']!r} does not publish port {port}: no client reaches it from outside its host",
        hint=f"publish it (-p HOSTPORT:{port}), or probe a published port (--probe tcp:PORT)",
    )


def cutover(ctx: Ctx) -> dict[str, Any]:
    """The cutover of a workload whose address does not move: its clients are told the target's
    endpoints, and the probe moves there."""
    rec = ctx.rec
    started = time.time()
    target = ctx.lab.node_address(rec["target"])
    rec["answers_at"] = [f"{target}:{p['host_port']}" for p in rec.get("published") or []]
    probe = rec.get("probe")
    if probe:
        observer = ctx.observer()
        if probe.get("id"):  # what the source's endpoint answered, for the blackout
            log = ctx.lab.dir / "probes" / f"{rec['id']}-source.json"
            log.parent.mkdir(exist_ok=True)
            log.write_text(json.dumps(observer.stop_probe(probe["id"])))
            probe["source_log"] = str(log)
        probe["source_host"], probe["host"] = probe["host"], target
        probe["id"] = observer.start_probe({k: probe[k] for k in ("host", "port", "path", "interval")})
    return {"router": "none", "addr": target, "started": started, "ended": time.time()}


def source_records(probe: ProbeRec) -> list[dict[str, Any]]:
    """The probes of the source's endpoint, up to the cutover (empty when the probe never moved)."""
    if not probe.get("source_log"):
        return []
    with open(probe["source_log"]) as f:
        return list(json.load(f))
