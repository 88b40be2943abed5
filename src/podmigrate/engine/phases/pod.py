"""Whole-pod phases (lab): every member dumped and restored under one lock of the pod's network
namespace, so their loopback connections (server <-> sidecar) survive; the copy keeps the address.

Neighbours: ``container`` (undo_restore and delete_target_copy are shared), ``traffic``.
"""

from __future__ import annotations

from podmigrate.engine.phases.container import agent_to_agent, expect_seal
from podmigrate.engine.phases.context import Ctx


def pod_checkpoint(ctx: Ctx) -> None:
    rec = ctx.rec
    pod = rec["pod"]
    res = ctx.agent(rec["source"] or "").post(
        f"/v1/pods/{pod['name']}/checkpoint",
        {
            "checkpoint_id": rec["id"],
            "members": pod.get("checkpointed", pod["members"]),
            "tcp_established": rec["plan"]["tcp_established"],
            "leave_running": rec["mode"] == "decoupled",
        },
    )
    rec["freeze_started"] = res["started"]
    rec["checkpoint_at"] = res["ended"]
    rec.setdefault("criu", {})["dump"] = {m: r["stats"] for m, r in res["members"].items()}
    rec.setdefault("bytes", {})["archive"] = sum(r["archive_bytes"] for r in res["members"].values())


def undo_pod_checkpoint(ctx: Ctx) -> str:
    rec = ctx.rec
    src = ctx.agent(rec["source"] or "")
    res = src.post(
        f"/v1/pods/{rec['pod']['name']}/restore-in-place",
        {"members": rec["pod"]["members"], "tcp_established": rec["plan"]["tcp_established"]},
    )
    src.delete(f"/v1/checkpoints/{rec['id']}")
    return f"restored {', '.join(res['restored']) or 'nothing'} in place in pod {rec['pod']['name']} on {rec['source']}"


def pod_transfer(ctx: Ctx) -> None:
    rec = ctx.rec
    sealed = expect_seal(ctx)
    res = ctx.agent(rec["source"] or "").post(
        f"/v1/checkpoints/{rec['id']}/send-pod",
        {"node": rec["target"], "members": rec["pod"].get("checkpointed", rec["pod"]["members"]), **sealed},
    )
    rec["bytes"]["sent"] = res["bytes"]
    agent_to_agent(ctx, res)


def pod_restore(ctx: Ctx) -> None:
    rec = ctx.rec
    pod = rec["pod"]
    res = ctx.agent(rec["target"]).post(
        f"/v1/pods/{pod['name']}/restore",
        {
            "checkpoint_id": rec["id"],
            "members": pod.get("checkpointed", pod["members"]),
            "fresh": pod.get("fresh", []),
            "mac": pod.get("mac"),
            "ip": rec["service_addresses"][0],
            "image": rec["image"],
            "tcp_established": rec["plan"]["tcp_established"],
        },
    )
    rec["criu"]["restore"] = res["members"]
    rec["restored_at"] = res["ended"]
