"""The phases that move one container's checkpoint (lab): dump, the three transports, restore; and
the cold baseline's stop and start.

Neighbours: ``validate`` before them, ``traffic`` after (cutover, verify, cleanup), ``lazy`` and
``pod`` for the variants of checkpoint and restore; ``engine.plans`` orders them.
"""

from __future__ import annotations

import os
import time
from typing import Any

from podmigrate.engine import breakdown, paths
from podmigrate.engine.phases import segment, traffic
from podmigrate.engine.phases.context import Ctx
from podmigrate.errors import PodmigrateError


def speculate(ctx: Ctx) -> None:
    """Before the freeze: the target's podman does its part of the restore from the source's skeleton
    of the container and waits at a gate for the real images (``runtime.speculative``). If it cannot,
    the migration goes on without: the record says why. Not where that skeleton's network would
    compete with the serving source: a new address (router none), or the same on a shared segment."""
    rec = ctx.rec
    if rec.get("copy_network"):  # not the source's own network: a new address, or a new MAC on a segment
        rec["speculative"] = {"state": "not used", "why": "its network would exist before the source froze"}
        return
    try:
        skeleton = ctx.agent(rec["source"] or "").get(f"/v1/containers/{rec['container']}/skeleton")
        res = ctx.agent(rec["target"]).post(
            f"/v1/checkpoints/{rec['id']}/speculate",
            {"skeleton": skeleton, "tcp_established": rec["plan"]["tcp_established"]},
        )
    except PodmigrateError as e:  # unreachable, refused, or a node without it: restored after the dump
        rec["speculative"] = {"state": "not used", "why": str(e)[:300]}
        return
    rec["speculative"] = {"state": "waiting", "podman_s": round(res["at_gate"] - res["started"], 4)}


def cancel_speculation(ctx: Ctx) -> None:
    rec = ctx.rec
    if (rec.get("speculative") or {}).get("state") == "waiting":
        ctx.agent(rec["target"]).delete(f"/v1/checkpoints/{rec['id']}/speculate")
        rec["speculative"]["state"] = "cancelled"


def restores_from_local_pages(rec: Any) -> bool:
    """Whether a streamed dump's restore leaves the memory in the target's images for a local
    lazy-pages daemon (and so goes through ``runtime.lazy``, where a speculative restore waits)."""
    caps = ((rec.get("nodes") or {}).get(rec["target"]) or {}).get("capabilities") or {}
    return rec.get("transport") == "stream" and bool(caps.get("lazy_pages")) and not paths.old(rec, "eager-restore")


def checkpoint(ctx: Ctx) -> None:
    rec = ctx.rec
    # a stop-copy's blackout includes the restore: podman's and runc's part of it goes before the freeze
    if rec["mode"] == "stop-copy" and restores_from_local_pages(rec) and not paths.old(rec, "restore-after-dump"):
        speculate(ctx)
    segment.withdraw_source(ctx)
    res = ctx.agent(rec["source"] or "").post(
        f"/v1/containers/{rec['container']}/checkpoint",
        {
            "checkpoint_id": rec["id"],
            "tcp_established": rec["plan"]["tcp_established"],
            "leave_running": rec["mode"] == "decoupled",
            # streamed: pages go straight to the target's page server; a stop-copy source stays
            # frozen (not killed) until the target serves, as the copy to roll back to
            "page_server": rec.get("page_server"),
            "leave_stopped": rec.get("leave_stopped", False),
            **(ctx.seal() if (rec.get("page_server") or {}).get("relay") else {}),
            **(ctx.criu_tls() if rec.get("page_server") else {}),
            **({"network_lock": "iptables"} if paths.old(rec, "iptables-network-lock") else {}),
        },
    )
    rec["freeze_started"] = res["started"]
    rec["checkpoint_at"] = res["ended"]
    rec.setdefault("criu", {})["dump"] = res["stats"]
    rec.setdefault("bytes", {})["archive"] = res["archive_bytes"]
    breakdown.note(rec, "source", res.get("timeline"))
    if rec.get("page_server"):
        rec["bytes"]["pages"] = int(res["stats"].get("pages_written", 0)) * 4096
        if crossed := pages_crossed(rec["page_server"] or {}):
            rec["security"]["pages"] = crossed
    if res.get("page_relay"):
        rec["bytes"]["page_relay"] = res["page_relay"]["bytes"]


def undo_checkpoint(ctx: Ctx) -> str:
    rec = ctx.rec
    cancel_speculation(ctx)
    src = ctx.agent(rec["source"] or "")
    c = {x["name"]: x for x in src.get("/v1/containers")}.get(rec["container"])
    out = "source container untouched"
    if c and c["state"] == "running" and rec.get("leave_stopped"):
        res = src.post(f"/v1/containers/{rec['container']}/resume")
        out = f"resumed {rec['container']} on {rec['source']} ({len(res['woken'])} tasks, unlocked {res['unlocked']})"
    if c and c["state"] != "running":
        src.post(f"/v1/containers/{rec['container']}/restore", {"tcp_established": rec["plan"]["tcp_established"]})
        out = f"restored {rec['container']} in place on {rec['source']}"
    src.delete(f"/v1/checkpoints/{rec['id']}")
    return out + segment.take_back(ctx)


def push(ctx: Ctx) -> None:
    from podmigrate.transport.registry import checkpoint_annotations

    rec = ctx.rec
    ann = checkpoint_annotations(
        rec["container"], {"io.podmigrate.migration": rec["id"], "io.podmigrate.source-node": rec["source"] or ""}
    )
    res = ctx.agent(rec["source"] or "").post(
        f"/v1/checkpoints/{rec['id']}/push",
        {
            "reference": rec["reference"],
            "annotations": ann,
            "compression": rec["plan"].get("compression", "none"),
            **ctx.seal(),
        },
    )
    rec["security"]["sealed"] = bool(res.get("sealed"))
    rec["checkpoint_image"] = {
        "reference": res["reference"],
        "manifest_digest": res["manifest_digest"],
        "layer_digest": res["layer_digest"],
    }
    rec["bytes"]["pushed"] = res["bytes"]


def undo_push(ctx: Ctx) -> str:
    rec = ctx.rec
    gone = ctx.agent(rec["source"] or "").post(
        "/v1/registry/delete", {"reference": rec["reference"], "checkpoint_id": rec["id"]}
    )["deleted"]
    return f"deleted {rec['reference']}" if gone else "no image to delete"


def checkpoint_id(rec: Any) -> str:
    """The checkpoint a migration moves: its own id, or a parked one's (which its seal names)."""
    return str(rec.get("checkpoint_id") or rec["id"])


def pull(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["target"]).post(
        f"/v1/checkpoints/{checkpoint_id(rec)}/pull", {"reference": rec["reference"], **ctx.seal()}
    )
    if res["layer_digest"] != rec["checkpoint_image"]["layer_digest"]:
        raise PodmigrateError(
            f"the registry served {res['layer_digest']} for {rec['reference']}, but "
            f"{rec['checkpoint_image']['layer_digest']} was pushed"
        )
    rec["bytes"]["pulled"] = res["bytes"]
    rec["security"]["sealed"] = bool(res.get("sealed"))


def delete_target_copy(ctx: Ctx) -> str:
    """The undo of everything that put checkpoint data on the target: pull, transfer, page server."""
    ctx.agent(ctx.rec["target"]).delete(f"/v1/checkpoints/{checkpoint_id(ctx.rec)}")
    return f"deleted the archive on {ctx.rec['target']}"


def expect_seal(ctx: Ctx) -> dict[str, Any]:
    """Give the target this migration's key before anything sealed is uploaded to it; the fields
    that seal the upload (``digest``: hashed on both ends as well, the old path)."""
    sealed = ctx.seal()
    if sealed:
        ctx.agent(ctx.rec["target"]).post(f"/v1/checkpoints/{ctx.rec['id']}/seal", sealed)
        if paths.old(ctx.rec, "sha256-of-sealed-streams"):
            sealed["digest"] = True
    return sealed


def transfer(ctx: Ctx) -> None:
    rec = ctx.rec
    sealed = expect_seal(ctx)
    res = ctx.agent(rec["source"] or "").post(f"/v1/checkpoints/{rec['id']}/send", {"node": rec["target"], **sealed})
    rec["bytes"]["sent"] = res["bytes"]
    breakdown.note(rec, "source", [["stream: sending the archive", res.get("started"), res.get("ended")]])
    rec["stream"] = {
        "sha256": res["sha256"],
        "sealed": res.get("sealed", False),
        "seconds": round(res["ended"] - res["started"], 4),
    }
    agent_to_agent(ctx, res)


def agent_to_agent(ctx: Ctx, res: dict[str, Any]) -> None:
    """What the source agent's answer to an upload says about how it crossed to the target."""
    ctx.rec["security"]["sealed"] = bool(res.get("sealed"))
    if res.get("channel"):
        ctx.rec["security"]["agents"] = res["channel"]


def pages_crossed(ps: dict[str, Any]) -> str | None:
    """How a dump's memory pages crossed into the page server ``ps`` (its answer): the agents'
    sealed relay, CRIU's TLS, or neither; None if the answer does not say."""
    if ps.get("relay"):
        return "sealed relay"
    if "criu_tls" not in ps:
        return None
    return "criu tls" if ps["criu_tls"] else "plain"


def page_server(ctx: Ctx) -> None:
    rec = ctx.rec
    sealed = ctx.seal()
    # sealed migrations send their pages through the agents' sealed relay, not CRIU's TLS
    relay = bool(sealed) and not paths.old(rec, "criu-tls-pages")
    ps = ctx.agent(rec["target"]).post(
        f"/v1/checkpoints/{rec['id']}/page-server",
        {"relay": relay, "peer": ctx.lab.node_address(rec["source"] or ""), **(sealed if relay else ctx.criu_tls())},
    )
    rec["page_server"] = ps  # how the pages cross (relay, criu_tls) goes into security once they have
    rec["leave_stopped"] = rec["mode"] == "stop-copy"


def restore(ctx: Ctx) -> None:
    rec = ctx.rec
    body: dict[str, Any] = {"tcp_established": rec["plan"]["tcp_established"]}
    if rec.get("copy_network"):
        body["copy_network"] = rec["copy_network"]
    if paths.old(rec, "restore-image-check"):
        body["image"] = rec["image"]
    if restores_from_local_pages(rec):
        body["lazy_local"] = True  # the pages are in the target's images: copied in as the copy runs
        body["wake_faults"] = os.environ.get("PODMIGRATE_LAZY_WAKE", "1") != "0"  # as in lazy mode
    body["speculative"] = (rec.get("speculative") or {}).get("state") == "waiting"
    res = ctx.agent(rec["target"]).post(f"/v1/checkpoints/{checkpoint_id(rec)}/restore", body)
    rec["lazy_local"] = bool(res.get("lazy_local"))
    if res.get("speculative"):
        rec["speculative"]["state"] = res["speculative"]
    rec["criu"]["restore"] = res["stats"]
    rec["restored_at"] = res["ended"]
    breakdown.note(rec, "target", res.get("timeline"))
    if paths.old(rec, "restored-check-before-cutover"):
        check_restored(ctx)
    else:  # a copy that is not what it should be fails verify, which rolls it back (engine.paths)
        rec["restored_check"] = "after the first answer"


def verify(ctx: Ctx) -> None:
    traffic.verify(ctx)
    if ctx.rec.get("restored_check"):
        check_restored(ctx)


def check_restored(ctx: Ctx) -> None:
    """The copy runs, with exactly the service addresses the source had (where they move)."""
    rec = ctx.rec
    new = {c["name"]: c for c in ctx.agent(rec["target"]).get("/v1/containers")}.get(rec["container"])
    if not new or new["state"] != "running":
        raise PodmigrateError(f"{rec['container']} is not running on {rec['target']} after restore")
    if rec.get("keep_address", True) and sorted(new["ips"]) != sorted(rec["service_addresses"]):
        raise PodmigrateError(
            f"{rec['container']} came back with addresses {new['ips']}, not {rec['service_addresses']}"
        )


def undo_restore(ctx: Ctx) -> str:
    rec = ctx.rec
    tgt = ctx.agent(rec["target"])
    if any(c["name"] == rec["container"] for c in tgt.get("/v1/containers")):
        tgt.delete(f"/v1/containers/{rec['container']}")
        return f"removed {rec['container']} from {rec['target']}"
    if rec.get("container_id"):  # a failed restore may have left storage under the container's ID
        tgt.delete(f"/v1/containers/{rec['container_id']}")
    return "nothing restored on the target"


def stop(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["source"] or "").post(f"/v1/containers/{rec['container']}/stop", {"timeout": 2})
    rec["freeze_started"] = res["started"]
    breakdown.note(rec, "source", [["podman stop", res["started"], res.get("ended")]])


def undo_stop(ctx: Ctx) -> str:
    rec = ctx.rec
    src = ctx.agent(rec["source"] or "")
    name, fresh = rec["container"], f"{rec['container']}-pm-restarted"
    present = {x["name"]: x for x in src.get("/v1/containers")}
    c = present.get(name)
    if c and c["state"] != "running":
        if rec.get("spec", {}).get("ip"):
            # `podman start` would give it the subnet's next free address, not its own (the fault
            # matrix saw .4 come back as .5): the service address is the workload's identity, so the
            # container is made again from the spec validate saved, with that address pinned. In an
            # order a retry can finish: the new one first (the stopped one holds no address), then
            # the old one removed (only it knows the environment's values), then the name moved over
            spec = full_spec(ctx)
            if fresh in present:
                src.delete(f"/v1/containers/{fresh}")
            src.post("/v1/containers", {**spec, "name": fresh})
            src.delete(f"/v1/containers/{name}")
            src.post(f"/v1/containers/{fresh}/rename", {"to": name})
        else:
            src.post(f"/v1/containers/{name}/start")
        return f"started {name} again on {rec['source']} (cold: its memory was lost)"
    if c is None and fresh in present:  # an undo cut short after the old container was removed
        src.post(f"/v1/containers/{fresh}/rename", {"to": name})
        return f"finished restarting {name} on {rec['source']} (cold: its memory was lost)"
    return "source container untouched"


def full_spec(ctx: Ctx) -> dict[str, Any]:
    """The spec validate saved, with the environment's values read again from the source's (stopped)
    container: the record holds only their names."""
    rec = ctx.rec
    live = ctx.agent(rec["source"] or "").get(f"/v1/containers/{rec['container']}/spec")
    return {**rec["spec"], "env": live.get("env") or {}}


def start_fresh(ctx: Ctx) -> None:
    spec = full_spec(ctx)
    t0 = time.time()  # the target's clock is this one in the lab (engine.breakdown)
    ctx.agent(ctx.rec["target"]).post("/v1/containers", spec)
    breakdown.note(ctx.rec, "target", [["podman run (a fresh process)", t0, time.time()]])
