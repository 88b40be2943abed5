"""Parking a container in the registry, and restoring it later (lab): the phases that differ from a
migration's. ``engine.plans`` has the two rows (container / park: validate, checkpoint, push, park,
cleanup; parked / stop-copy: validate, pull, restore, cutover, verify, cleanup); checkpoint, push,
pull, restore, cutover and verify are the migration's own (``container``, ``traffic``);
``engine.parking`` keeps what is parked between the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from podmigrate.engine import inventory, parking
from podmigrate.engine.phases.context import Ctx
from podmigrate.engine.phases.fit import check_fit, check_spec
from podmigrate.engine.phases.traffic import best_effort
from podmigrate.engine.phases.validate import check_node, image_on_target, probe_and_state, refuse_leftovers
from podmigrate.errors import UsageError


def validate_park(ctx: Ctx) -> None:
    """What is parked, checked before anything is frozen; its service goes dark until a restore."""
    rec = ctx.rec
    loc = inventory.locate(ctx.lab, rec["workload"])
    c = loc.container
    if c["pod"]:
        raise UsageError(
            f"{c['name']!r} belongs to pod {c['pod']!r}; a pod is not parked",
            hint="move the pod to another node: podmigrate migrate NAME --to NODE",
        )
    refuse_leftovers(loc, rec["workload"])
    if any(e["workload"] == c["name"] for e in parking.listing(ctx.lab)):
        raise UsageError(
            f"a checkpoint of {c['name']!r} is parked already; parking this one would make it unrestorable",
            hint=f"restore the parked one first (podmigrate restore {c['name']} --to NODE), or rename this one",
        )
    rec["source"], rec["container"], rec["container_id"] = loc.node, c["name"], c["id"]
    rec["image"], rec["service_addresses"] = c["image"], list(c["ips"])
    rec["image_id"] = str(c.get("image_id") or "")
    check_node(ctx, loc.node)
    check_spec(ctx.agent(loc.node).get(f"/v1/containers/{c['name']}/spec"), c["name"], ctx.lab.workload_network)
    rec["rss_bytes"] = ctx.agent(loc.node).get(f"/v1/containers/{c['name']}/memory")["rss_bytes"]
    probe_and_state(ctx, loc)
    # nobody answers until the restore: no blackout to probe, the restore's verify waits for the copy
    rec["service_probe"] = rec.pop("probe", None)
    ctx.report(f"{c['name']} ({c['id'][:12]}) on {loc.node} -> the registry, address {', '.join(c['ips']) or 'none'}")


def park(ctx: Ctx) -> None:
    rec = ctx.rec
    sealed = bool(rec["security"].get("sealed"))  # as the push said it went up
    entry: dict[str, Any] = {
        "workload": rec["workload"],
        "container": rec["container"],
        "container_id": rec["container_id"],
        "migration": rec["id"],
        "checkpoint_id": rec["id"],  # what the image is sealed for
        "reference": rec["reference"],
        "checkpoint_image": rec["checkpoint_image"],
        "bytes": rec["bytes"].get("pushed"),
        "image": rec["image"],
        "image_id": rec.get("image_id", ""),
        "source": rec["source"],
        "source_node": rec["nodes"][rec["source"] or ""],
        "service_addresses": rec["service_addresses"],
        "rss_bytes": rec["rss_bytes"],
        "probe": rec.get("service_probe"),
        "state_before": rec.get("state_before"),
        "freeze_started": rec["freeze_started"],
        "parked_at": time.time(),
        "sealed": sealed,
    }
    parking.save(ctx.lab, entry, ctx.seal_key if sealed else None)
    rec["parked"] = {"reference": rec["reference"], "restore": f"podmigrate restore {rec['workload']} --to NODE"}


def undo_park(ctx: Ctx) -> str:
    mine = [e for e in parking.listing(ctx.lab) if e.get("migration") == ctx.rec["id"]]
    if mine:  # only this park's entry: never another one's under the same name
        parking.remove(ctx.lab, ctx.rec["workload"])
    return "forgot the parked entry" if mine else "nothing parked"


def cleanup_park(ctx: Ctx) -> None:
    """The stopped source container and its local archive go (the name is free for the restore
    anywhere, this node included); the image and the entry stay for the restore."""
    rec = ctx.rec
    src = ctx.agent(rec["source"] or "")
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("source container", lambda: src.delete(f"/v1/containers/{rec['container']}")),
        ("source archive", lambda: src.delete(f"/v1/checkpoints/{rec['id']}")),
    )
    best_effort(rec, steps)


def validate_restore(ctx: Ctx) -> None:
    """The parked entry (set by ``controller.restore``) against the target, before anything moves."""
    rec = ctx.rec
    entry: dict[str, Any] = rec["parked"]
    inv = inventory.inventory(ctx.lab)
    try:
        loc = inventory.locate(ctx.lab, rec["workload"], inv)
    except UsageError:
        loc = None
    if loc is not None:
        raise UsageError(
            f"{rec['workload']!r} runs on {loc.node} already; its parked checkpoint is older than it",
            hint=f"remove one of the two: podmigrate lab exec {loc.node} -- podman rm -f {rec['workload']}",
        )
    taken = {ip: c["name"] for cs in inv.values() for c in cs if c["state"] == "running"
             for ip in c["ips"] if ip in entry["service_addresses"]}  # fmt: skip
    if taken:
        raise UsageError(
            f"{rec['workload']!r}'s address is taken: " + ", ".join(f"{ip} by {n}" for ip, n in taken.items()),
            hint="a restore brings the workload back with its own address; stop the container that holds it",
        )
    rec["container"], rec["container_id"], rec["source"] = entry["container"], entry["container_id"], entry["source"]
    rec["image"], rec["image_id"], rec["rss_bytes"] = entry["image"], entry["image_id"], entry["rss_bytes"]
    rec["service_addresses"] = entry["service_addresses"]
    if entry.get("state_before"):
        rec["state_before"] = entry["state_before"]
    rec["freeze_started"] = float(entry["freeze_started"])  # the service has been down since
    rec["bytes"], rec["criu"] = {"archive": int(entry.get("bytes") or 0)}, {}
    rec.setdefault("nodes", {})[entry["source"]] = entry["source_node"]  # it may be gone: as it was
    check_node(ctx, rec["target"])
    check_fit(ctx, int(entry["rss_bytes"]))
    rec["target_image"] = image_on_target(
        ctx, entry["source"], {"image": entry["image"], "image_id": entry["image_id"]}
    )
    if entry.get("probe"):
        rec["probe"] = entry["probe"]
    ctx.report(f"{rec['container']} from {rec['reference']} -> {rec['target']}, parked on {entry['source']}")


def cleanup_restore(ctx: Ctx) -> None:
    rec = ctx.rec
    tgt = ctx.agent(rec["target"])
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("target archive", lambda: tgt.delete(f"/v1/checkpoints/{rec['checkpoint_id']}")),
        ("registry image", lambda: tgt.post("/v1/registry/delete", {"reference": rec["reference"]})),
    )
    best_effort(rec, steps)
    parking.remove(ctx.lab, rec["workload"])
    rec["parked_for_s"] = round(time.time() - float(rec["parked"]["parked_at"]), 3)
