"""Garbage collection: what failed or interrupted migrations can leave behind, found and removed.

Leftovers are recognised by what they are, not by a list kept elsewhere: checkpoint archives (and
partial ones) on nodes, checkpoint images in the registry, stopped copies of a container that runs
on another node, and /32 routes to addresses no running container holds. Anything that belongs to a
migration still running (a live controller) is left alone.
"""

from __future__ import annotations

import json
from typing import Any

from podmigrate.claims import Claims
from podmigrate.engine import inventory, parking
from podmigrate.engine.cluster import Cluster
from podmigrate.engine.controller import recover, store_for
from podmigrate.engine.phases.context import Report

CHECKPOINT_REPOS = "podmigrate/checkpoints/"


def collect(lab: Cluster, dry_run: bool = False, report: Report = lambda _m: None) -> dict[str, list[str]]:
    store = store_for(lab)
    if not dry_run:
        recover(lab, store, report)
    # what a migration running right now holds is not garbage, even before its first record is saved
    busy = Claims(lab.dir).busy()
    active = {r["id"] for r in store.active()} | {mid for mid, _ in busy.values()}
    found: dict[str, list[str]] = {"archives": [], "images": [], "containers": [], "routes": []}
    inv = inventory.inventory(lab)
    running = {c["name"]: n for n, cs in inv.items() for c in cs if c["state"] == "running"}
    held = {ip for cs in inv.values() for c in cs if c["state"] == "running" for ip in c["ips"]}
    # a parked workload's image is its only copy, and its address is still its own
    parked = parking.listing(lab)
    active |= {str(e["checkpoint_id"]) for e in parked}
    held |= {ip for e in parked for ip in e.get("service_addresses") or []}
    for node in lab.nodes:
        agent = lab.agent(node)
        try:
            for f in agent.get("/v1/checkpoints"):
                if f["id"] not in active:
                    found["archives"].append(f"{node}:{f['file']}")
                    if not dry_run:
                        agent.delete(f"/v1/checkpoints/{f['id']}")
            for c in inv[node]:
                owner = c["pod"] or c["name"]
                if owner in busy or any(c["name"].startswith(f"{w}-") for w in busy):
                    continue  # a running migration's rollback copy or its new copy
                if c["state"] != "running" and running.get(c["name"], node) != node:
                    found["containers"].append(f"{node}:{c['name']} ({c['state']}; runs on {running[c['name']]})")
                    if not dry_run:
                        agent.delete(f"/v1/containers/{c['name']}")
        finally:
            agent.close()
    node_agent = lab.agent(lab.nodes[0])
    router, observer = lab.traffic(), lab.observer()
    try:
        catalog = observer.get(f"http://{lab.registry}/v2/_catalog")
        repos = json.loads(catalog["body"]).get("repositories", []) if catalog["ok"] else []
        for repo in repos:
            if not repo.startswith(CHECKPOINT_REPOS):
                continue
            tags = observer.get(f"http://{lab.registry}/v2/{repo}/tags/list")
            for tag in (json.loads(tags["body"]).get("tags") or []) if tags["ok"] else []:
                if tag not in active:
                    ref = f"{lab.registry}/{repo}:{tag}"
                    found["images"].append(ref)
                    if not dry_run:
                        node_agent.post("/v1/registry/delete", {"reference": ref})
        for r in router.routes() if not busy else []:  # a running migration moves routes
            dst = str(r["dst"])
            if "/" not in dst and lab.is_service_address(dst) and dst not in held:
                found["routes"].append(f"{dst} via {r['via']}")
                if not dry_run:
                    router.remove(dst)
    finally:
        node_agent.close()
        router.close()
        observer.close()
    return found


def summary(found: dict[str, Any]) -> str:
    n = sum(len(v) for v in found.values())
    return "nothing to collect" if not n else "; ".join(f"{len(v)} {k}" for k, v in found.items() if v)
