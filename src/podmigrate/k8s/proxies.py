"""Waiting for the nodes' Service proxies to follow an EndpointSlice change.

The API server's EndpointSlices say which pods a Service selects; each node's kube-proxy turns them
into rules on its own schedule (at least ``minSyncPeriod``, 1 s by default, between two syncs). Until
it has, requests still reach a pod the slices no longer list: a stop-copy source after its isolation
(they would be answered after its checkpoint, and lost with it: a client saw its counter go back in
5 of 15 stop-copy runs of ``bench k8s``), a decoupled source deleted right after the cutover (they are
refused). kube-proxy's ``/healthz`` (port 10256 on every node) tells, per address family, when its
rules were last written, and its own clock: a mark taken from that clock once the slices changed,
and then a later write on every node, means every proxy has followed, whatever the clocks' skew.
A cluster without kube-proxy (or with its healthz out of reach) gets a fixed wait instead.
"""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import datetime
from typing import Any

from podmigrate.k8s import api as k
from podmigrate.k8s.context import Ctx

HEALTHZ_PORT = 10256


def _healthz(ip: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{ip}:{HEALTHZ_PORT}/healthz", timeout=0.5) as r:
            return dict(json.loads(r.read()))
    except (OSError, ValueError):
        return None


def _time(value: str) -> datetime:
    """RFC 3339 with nanoseconds (Go's), to microseconds."""
    head, _, frac = value.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")


def mark(ctx: Ctx) -> dict[str, str]:
    """Each node's kube-proxy's own time now, before a change of the Services (``follow`` waits for a
    write after it); empty where no kube-proxy healthz answers."""
    ips = []
    for node in ctx.api.list(k.nodes()):
        addresses = (node.get("status") or {}).get("addresses") or []
        ips += [a["address"] for a in addresses if a.get("type") == "InternalIP"]
    return {ip: str(h["currentTime"]) for ip in ips if (h := _healthz(ip)) and h.get("currentTime")}


def follow(ctx: Ctx, marks: dict[str, str], timeout: float = 5.0) -> dict[str, Any]:
    """Return once every node's kube-proxy wrote its rules after its ``marks`` and has nothing left
    queued (or after ``drain_s``, where no kube-proxy answered)."""
    t0 = time.monotonic()
    if not marks:
        time.sleep(ctx.config.drain_s)
        return {"proxies": 0, "seconds": round(time.monotonic() - t0, 3), "how": "fixed wait (no kube-proxy healthz)"}
    pending = set(marks)
    while pending and time.monotonic() - t0 < timeout:
        for ip in sorted(pending):
            h = _healthz(ip)
            if h is not None and _after(h, _time(marks[ip])):
                pending.discard(ip)
        if pending:
            time.sleep(ctx.config.blackout_poll_s)
    if pending:
        ctx.event("Warning", "ProxiesBehind", f"kube-proxy on {sorted(pending)} had not synced after {timeout:.0f} s")
    return {"proxies": len(marks), "behind": sorted(pending), "seconds": round(time.monotonic() - t0, 3)}


def settle(ctx: Ctx, marks: dict[str, str], timeout: float = 5.0) -> dict[str, Any]:
    """Before a freeze that a Service change (``marks`` taken before it) came just ahead of: once every
    kube-proxy has written that change, until its last write is ``proxy_min_sync_s`` old. kube-proxy
    writes rules at most once per minSyncPeriod, so a cutover sooner than that after the last write
    would reach the clients only when the period is over, inside the blackout; here it costs the
    migration's time instead. Nothing waits where no kube-proxy answers."""
    t0 = time.monotonic()
    if not marks:
        return {"proxies": 0, "seconds": 0.0}
    followed = follow(ctx, marks, timeout)
    while time.monotonic() - t0 < timeout:
        ages = [_age(h) for ip in marks if (h := _healthz(ip)) is not None]
        if all(a >= ctx.config.proxy_min_sync_s for a in ages):
            break
        time.sleep(max(0.01, ctx.config.proxy_min_sync_s - min(ages)))
    return {**followed, "seconds": round(time.monotonic() - t0, 3)}


def _age(h: dict[str, Any]) -> float:
    """Seconds since the proxy last wrote its rules (any address family), on its own clock."""
    wrote = [_time(f["lastUpdated"]) for f in (h.get("status") or {}).values() if f.get("lastUpdated")]
    if not wrote or not h.get("currentTime"):
        return float("inf")
    return (_time(h["currentTime"]) - max(wrote)).total_seconds()


def _after(h: dict[str, Any], mark: datetime) -> bool:
    """Whether the proxy wrote its rules (for any address family) after ``mark``, on its own clock, and
    has no change queued (its top-level lastUpdated is then its current time)."""
    families = (h.get("status") or {}).values()
    wrote = any(_time(f["lastUpdated"]) > mark for f in families if f.get("lastUpdated"))
    idle = bool(h.get("lastUpdated")) and _time(h["lastUpdated"]) >= _time(h["currentTime"])
    return wrote and idle
