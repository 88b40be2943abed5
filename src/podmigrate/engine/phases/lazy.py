"""Post-copy (lazy) phases (lab): dump all but the memory, restore at once, pull the pages after.

Neighbours: ``container`` (transfer and undo_restore are shared), ``traffic``; the agents' lazy
routes drive CRIU's lazy-pages daemon and the fault waker (``runtime/uffd.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from podmigrate.engine import breakdown, paths
from podmigrate.engine.phases import segment
from podmigrate.engine.phases.container import cancel_speculation, checkpoint_id, expect_seal, speculate
from podmigrate.engine.phases.context import Ctx
from podmigrate.errors import AgentError, PodmigrateError
from podmigrate.runtime import prefetch

if TYPE_CHECKING:
    from podmigrate.engine.cluster import Cluster

# the smallest mappings' pages that go beside a lazy dump (agent.node_prefetch, runtime.prefetch's
# budget); the restore waits for them at most PREFETCH_WAIT_S, then goes on fully lazy
PREFETCH_MB = int(os.environ.get("PODMIGRATE_LAZY_PREFETCH_MB", str(prefetch.DEFAULT_MB)))
PREFETCH_WAIT_S = 0.5
AGENT_PATIENCE_S = 30.0  # how long the pages phase waits for an unreachable target agent
_pause = time.sleep  # the pages phase's polling pause (tests make it instant)


def lazy_checkpoint(ctx: Ctx) -> None:
    rec = ctx.rec
    if not paths.old(rec, "restore-after-dump"):
        speculate(ctx)
    # sealed migrations' pages cross through the agents' sealed relay, not CRIU's TLS
    relay = bool(ctx.seal()) and not paths.old(rec, "lazy-criu-tls")
    body: dict[str, Any] = {
        "checkpoint_id": rec["id"],
        "tcp_established": rec["plan"]["tcp_established"],
        **ctx.criu_tls(),  # the pages the copy fetches later: the restore's end asks for the same
        "relay": relay,
        **({"peer": ctx.lab.node_address(rec["target"]), **ctx.seal()} if relay else {}),
    }
    if paths.old(rec, "iptables-network-lock"):
        body["network_lock"] = "iptables"
    if paths.old(rec, "lazy-dump-splice"):
        body["lazy_dump"] = "splice"
    # sealed only: the target drops a deleted checkpoint's key, so a prefetch landing after a
    # rollback is refused there instead of left behind
    if PREFETCH_MB > 0 and ctx.seal() and not paths.old(rec, "lazy-prefetch"):
        sealed = expect_seal(ctx)  # before the source's upload can reach the target
        body["prefetch"] = {"mb": PREFETCH_MB, "node": rec["target"], **sealed}
    segment.withdraw_source(ctx)
    res = ctx.agent(rec["source"] or "").post(f"/v1/containers/{rec['container']}/checkpoint-lazy", body)
    rec["freeze_started"] = res["started"]
    rec["checkpoint_at"] = res["ended"]
    # podman started, CRIU serving pages (the tasks frozen and dumped but for their memory), the
    # target's part packed
    rec["lazy"] = {"address": res["address"], "port": res["port"], "times": res.get("times", {})}
    if res.get("relay"):  # the dump's own port on the source's loopback, for abort-lazy
        rec["lazy"]["relay"], rec["lazy"]["criu_port"] = True, int(res["criu_port"])
    rec["lazy"]["dump_mode"] = res.get("dump_mode", "splice")
    if res.get("prefetch"):
        rec["lazy"]["prefetch"] = {"source": "sending"}  # the pages phase puts the source's last word here
    rec.setdefault("criu", {})["dump"] = res["stats"]
    rec.setdefault("bytes", {})["archive"] = res["archive_bytes"]
    breakdown.note(rec, "source", res.get("times", {}).get("timeline"))


def undo_lazy_checkpoint(ctx: Ctx) -> str:
    rec = ctx.rec
    cancel_speculation(ctx)
    src = ctx.agent(rec["source"] or "")
    lazy = rec.get("lazy") or {}
    res = src.post(f"/v1/checkpoints/{rec['id']}/abort-lazy", {k: lazy.get(k) for k in ("port", "relay", "criu_port")})
    src.delete(f"/v1/checkpoints/{rec['id']}")
    c = {x["name"]: x for x in src.get("/v1/containers")}.get(rec["container"])
    if not c or c["state"] != "running":
        raise PodmigrateError(
            f"after aborting the lazy dump, {rec['container']} on {rec['source']} is {c['state'] if c else 'gone'}"
        )
    # CRIU thaws the tasks on that error path but leaves its network lock in place
    woke = src.post(f"/v1/containers/{rec['container']}/resume")
    return (
        f"the lazy dump gave up (exit {res.get('rc')}); {rec['container']} runs on {rec['source']}, "
        f"unlocked {woke['unlocked']}" + segment.take_back(ctx)
    )


def lazy_restore(ctx: Ctx) -> None:
    rec = ctx.rec
    # from now on what leaves the source on its LAN link is the pages the copy pulls (and a few probe
    # answers): lazy dumps have no page counts of their own (CRIU 4.2's stats-dump is empty for them)
    status = ctx.agent(rec["source"] or "").get(f"/v1/checkpoints/{rec['id']}/lazy")
    rec["lazy"]["lan_tx_before"] = status.get("lan_tx_bytes")
    res = ctx.agent(rec["target"]).post(
        f"/v1/checkpoints/{rec['id']}/restore-lazy",
        {
            **rec["lazy"],
            **({"image": rec["image"]} if paths.old(rec, "restore-image-check") else {}),
            "tcp_established": rec["plan"]["tcp_established"],
            **({"copy_network": rec["copy_network"]} if rec.get("copy_network") else {}),
            "prefetch_wait_s": PREFETCH_WAIT_S if rec["lazy"].get("prefetch") else 0,
            "speculative": (rec.get("speculative") or {}).get("state") == "waiting",
            "prefetch_defer": not paths.old(rec, "prefetch-wait-at-pre-restore"),
            # off only to measure what the waker saves (runtime/uffd.py)
            "wake_faults": os.environ.get("PODMIGRATE_LAZY_WAKE", "1") != "0",
            **ctx.criu_tls(),
            **(ctx.seal() if rec["lazy"].get("relay") else {}),
        },
    )
    if res.get("relay"):  # from here on the copy fetches its pages from the source, so connected
        rec["security"]["pages"] = "sealed relay"
    elif "criu_tls" in res:
        rec["security"]["pages"] = "criu tls" if res["criu_tls"] else "plain"
    rec["lazy"]["wake_faults"] = res.get("wake_faults", False)
    if rec["lazy"].get("prefetch"):
        rec["lazy"]["prefetch"].update(res.get("prefetch") or {"outcome": None})  # used, missed (too late)
    if res.get("speculative"):
        rec["speculative"]["state"] = res["speculative"]
    rec["criu"]["restore"] = res["stats"]
    rec["restored_at"] = res["ended"]
    breakdown.note(rec, "target", res.get("timeline"))


def lazy_pages(ctx: Ctx) -> None:
    """Wait until every page has moved: the target's lazy-pages daemon and the source's dump end."""
    rec = ctx.rec
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        status = ctx.agent(rec["source"] or "").get(f"/v1/checkpoints/{rec['id']}/lazy")
        src = status.get("src", {})
        target = ctx.agent(rec["target"]).get(f"/v1/checkpoints/{rec['id']}/lazy")
        dst = target.get("dst", {})
        if not src.get("running") and not dst.get("running"):
            lazy = rec["lazy"]
            lazy["source_rc"], lazy["daemon_rc"], lazy["all_pages_at"] = src.get("rc"), dst.get("rc"), time.time()
            if target.get("waker"):
                lazy["waker"] = target["waker"]
            if relayed := src.get("relay"):  # the source's end: the pages out, the daemon's requests in
                moved = relayed["bytes"]
                lazy["relay_bytes"] = {"pages": moved.get("pages-answers", 0), "requests": moved.get("pages", 0)}
            if lazy.get("prefetch") and status.get("prefetch"):  # what the source read and sent
                lazy["prefetch"].update({k: v for k, v in status["prefetch"].items() if k != "state"})
                lazy["prefetch"]["source"] = status["prefetch"].get("state")
            before, after = lazy.get("lan_tx_before"), status.get("lan_tx_bytes")
            if before is not None and after is not None:
                rec.setdefault("bytes", {})["pages"] = after - before
            huge_pages(ctx)
            return
        time.sleep(0.02)  # two status reads of the agents' memory: the source is released sooner
    raise PodmigrateError("the lazy page transfer did not finish within 30 minutes")


def huge_pages(ctx: Ctx) -> None:
    """Every page is in: the copy's memory goes back in the huge pages userfaultfd could not give it
    (``runtime.hugepages``), in the target agent's background (``agent.collapses``): neither the copy
    nor the released source waits for it, and an evacuation's next migration need not either. The
    copy serves either way, so a failure here is recorded, not rolled back."""
    rec = ctx.rec
    if paths.old(rec, "small-pages-after-lazy-restore"):
        return
    plan: Mapping[str, Any] = rec.get("plan") or {}
    if plan.get("huge_pages") == "deferred":  # its caller asks once it is done (engine.evacuate)
        rec["huge_pages"] = {"state": "deferred"}
        return
    body = {"background": not paths.old(rec, "huge-pages-inside-migration")}
    try:
        rec["huge_pages"] = ctx.agent(rec["target"]).post(f"/v1/containers/{rec['container']}/huge-pages", body)
    except PodmigrateError as e:
        rec["huge_pages"] = {"error": str(e)[:300]}


def collapsed(cluster: Cluster, rec: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """What the background collapse of a finished lazy migration's copy did, once it has ended
    (``timeout``: then its state so far); the record's own entry when none was started."""
    started = rec.get("huge_pages") or {}
    if started.get("state") != "collapsing":
        return dict(started)
    agent = cluster.agent(rec["target"])
    deadline = time.monotonic() + timeout
    while True:
        got: dict[str, Any] = agent.get(f"/v1/containers/{rec['container']}/huge-pages")
        if got.get("state") != "collapsing" or time.monotonic() > deadline:
            return got
        _pause(0.02)


def local_pages(ctx: Ctx) -> None:
    """A streamed restore whose memory a local lazy-pages daemon copies in (``container.restore``):
    wait until it has every page, before verify and before cleanup deletes the images it reads.
    Only an exit 0 that the target agent saw counts: a daemon it has no record of (the agent was
    restarted) may have died with pages missing, which the kernel would then fill with zeros.
    Nothing to wait for after an eager restore."""
    rec = ctx.rec
    if not rec.get("lazy_local"):
        return
    deadline = time.monotonic() + 1800
    unreachable_since: float | None = None
    while time.monotonic() < deadline:
        try:
            target = ctx.agent(rec["target"]).get(f"/v1/checkpoints/{checkpoint_id(rec)}/lazy")
        except AgentError:
            # rolling back would throw away what the copy has served so far: give the agent a while
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > AGENT_PATIENCE_S:
                raise
            _pause(0.5)
            continue
        unreachable_since = None
        dst = target.get("dst")
        if dst is None:
            raise PodmigrateError(
                f"{rec['target']}'s agent has no record of the lazy-pages daemon filling {rec['container']}'s "
                "memory (was the agent restarted?): the copy may miss pages"
            )
        if not dst.get("running"):
            if dst.get("rc") != 0:
                raise PodmigrateError(
                    f"the lazy-pages daemon filling {rec['container']}'s memory on {rec['target']} failed "
                    f"(exit {dst.get('rc')}): the copy may miss pages"
                )
            # when the controller saw it done (its poll), not when the daemon exited
            rec["local_pages"] = {"daemon_rc": 0, "seen_done_at": time.time(), "waker": target.get("waker")}
            huge_pages(ctx)
            return
        _pause(0.05)
    raise PodmigrateError("the local lazy-pages daemon did not finish within 30 minutes")
