"""The phases around the service's traffic (lab): the prober, cutover, verify and cleanup.

Neighbours: ``container``, ``lazy`` and ``pod`` move the workload before these run; the LAN agent
(``agent.lan``) routes, drains and probes; ``engine.blackout`` turns the probe log into figures.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from podmigrate.engine import inventory
from podmigrate.engine.blackout import blackout, counters_monotonic
from podmigrate.engine.phases import published
from podmigrate.engine.phases.context import Ctx
from podmigrate.engine.record import Record
from podmigrate.errors import PodmigrateError

PROBE_LEAD_S = 0.1


def start_probe(ctx: Ctx) -> None:
    probe = ctx.rec.get("probe")
    if probe and "id" not in probe:
        observer = ctx.observer()
        probe["id"] = observer.start_probe(dict(probe))
        # answers before the freeze, so that "last success before" exists: two are enough, and come
        # within 20-40 ms at 50 Hz; a service that does not answer is not waited for beyond 0.1 s
        deadline = time.monotonic() + PROBE_LEAD_S
        while time.monotonic() < deadline:
            if sum(bool(r.get("ok")) for r in observer.probe_records(probe["id"])) >= 2:
                return
            time.sleep(0.01)


def stop_probe_quietly(ctx: Ctx) -> None:
    probe = ctx.rec.get("probe") or {}
    if probe.get("id") and "records" not in probe:
        with contextlib.suppress(PodmigrateError):
            ctx.observer().cancel_probe(probe["id"])


def cutover(ctx: Ctx) -> None:
    rec = ctx.rec
    router = ctx.traffic()
    # decoupled: the source still serves, so connections it holds may finish there (if the router
    # can drain); the other modes froze the source and their restored connections must move now
    drain = rec["mode"] == "decoupled"
    switches = [router.switch(ip, rec["target"], drain) for ip in rec["service_addresses"]]
    if rec.get("keep_address") is False:  # the clients go to the target's address instead
        switches = [published.cutover(ctx)]
    rec["cutover"] = {
        "router": switches[0].get("router", "route") if switches else None,
        "switches": switches,
        "switch_s": round(sum(s["ended"] - s["started"] for s in switches), 6),
    }


def undo_cutover(ctx: Ctx) -> str:
    rec = ctx.rec
    router = ctx.traffic()
    for ip in rec["service_addresses"]:
        router.switch(ip, rec["source"] or "")
    return f"routed {', '.join(rec['service_addresses'])} back to {rec['source']}"


def end_drain(ctx: Ctx) -> None:
    """Let connections still open on the source finish (bounded by ``drain_timeout``), then send
    everything to the target: called just before the source is retired."""
    rec = ctx.rec
    cut = rec.get("cutover") or {}
    draining = [s["addr"] for s in cut.get("switches", []) if s.get("draining")]
    if not draining:
        return
    timeout = float(rec["plan"].get("drain_timeout", 2.0))
    cut["drain"] = [ctx.traffic().end_drain(ip, timeout) for ip in draining]


def verify(ctx: Ctx) -> None:
    rec = ctx.rec
    probe = rec.get("probe")
    if probe and probe["path"]:
        url = f"http://{probe['host']}:{probe['port']}{probe['path']}"
        deadline = time.monotonic() + rec["plan"]["verify_timeout"]
        while not ctx.observer().get(url, timeout=2)["ok"]:
            if time.monotonic() > deadline:
                raise PodmigrateError(f"{rec['container']} does not answer at {url} on {rec['target']}")
            time.sleep(0.02)
        rec["first_answer_at"] = time.time()
    before = rec.get("state_before")
    if probe and before:
        after = inventory.read_state(ctx.observer(), probe["host"], probe["port"])
        if after is None:
            raise PodmigrateError(f"{rec['container']} answers but /state fails on {rec['target']}")
        rec["state_after"] = after
        checks = state_checks(before, after)
        same_process = checks["same_process_start"]
        rec["checks"] = checks
        if rec["mode"] == "cold":
            # by design: a fresh process from the image; the heap is regenerated from the same seed,
            # so its digest matches, but everything the process did (the counter) is gone
            rec["state"] = "lost" if not same_process else "kept"
        elif not all(checks.values()):
            raise PodmigrateError(
                f"state check failed after restore on {rec['target']}: {checks}",
                details={"before": before, "after": after},
            )
        else:
            rec["state"] = "kept"
    finish_probe(ctx)


def finish_probe(ctx: Ctx) -> None:
    rec = ctx.rec
    probe = rec.get("probe")
    if not probe or not probe.get("id") or "records" in probe:
        return
    observer = ctx.observer()
    cut = (rec.get("cutover") or {}).get("switches", [{}])[-1].get("ended", time.time())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait for a few answers after the switch, then stop
        recs = observer.probe_records(probe["id"])
        if sum(1 for r in recs if r["ok"] and r["sent"] > cut) >= 3:
            break
        time.sleep(0.05)
    # not waiting up to a probe timeout (1 s) for the probes still in flight: those sent before
    # the first answer after the switch went to a frozen or unrouted copy and count as failed; those
    # sent after it cannot change the blackout and are left out (counted in ``pending_at_stop``)
    records = published.source_records(probe) + observer.stop_probe(probe["id"])
    records, probe["pending_at_stop"] = settle_pending(records, cut)
    log = ctx.lab.dir / "probes" / f"{rec['id']}.json"
    log.parent.mkdir(exist_ok=True)
    log.write_text(json.dumps(records))
    probe["log"] = str(log)
    start = float(rec.get("freeze_started") or rec["created"])
    b = blackout(records, start - 0.05, time.time())
    b["counters"] = counters_monotonic(records, cut)
    if rec.get("cutover"):
        b["at_cutover"] = blackout(records, rec["cutover"]["switches"][0]["started"] - 0.05, time.time())
    probe["records"] = len(records)
    rec["blackout"] = b
    if rec["mode"] == "decoupled":
        c = b["counters"]
        lost = (
            (c["max_before"] - c["min_after"]) if c["max_before"] is not None and c["min_after"] is not None else None
        )
        rec["drift"] = {"counter": lost, "since_checkpoint_s": round(cut - rec["checkpoint_at"], 4)}
    elif rec["mode"] in ("stop-copy", "lazy"):  # the copy resumes exactly where the source froze
        rec["drift"] = {"counter": 0, "since_checkpoint_s": 0.0}


def settle_pending(records: list[dict[str, Any]], cut: float) -> tuple[list[dict[str, Any]], int]:
    """A probe log with the probes still in flight at its stop settled (see ``finish_probe``)."""
    answered = [r for r in records if r["ok"] and not r.get("pending") and r["sent"] > cut]
    # an answer counts as the service being back by blackout()'s own rule: within the probe timeout
    back = min((r["sent"] for r in answered if r["answered"] - r["sent"] <= 1.0), default=None)
    now, out, n = time.time(), [], 0
    for r in records:
        if not r.get("pending"):
            out.append(r)
            continue
        n += 1
        if back is None or r["sent"] < back:
            out.append({**r, "ok": False, "answered": now, "error": "no answer when the probe stopped"})
    return out, n


def release_target_memory(ctx: Ctx) -> None:
    """Memory warmed for a restore that will not come (the agent also lets it go by itself)."""
    rec: Record = ctx.rec
    if rec.get("target_memory"):
        with contextlib.suppress(PodmigrateError):
            ctx.agent(rec["target"]).post(f"/v1/checkpoints/{rec['id']}/release-memory")


def cleanup(ctx: Ctx) -> None:
    release_target_memory(ctx)
    rec = ctx.rec
    src, tgt = rec["source"] or "", rec["target"]
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("drain", lambda: end_drain(ctx)),
        (
            "source container",
            lambda: ctx.agent(src).post(f"/v1/containers/{rec['container']}/retire", {"ips": rec["service_addresses"]}),
        ),
        ("source archive", lambda: ctx.agent(src).delete(f"/v1/checkpoints/{rec['id']}")),
        ("target archive", lambda: ctx.agent(tgt).delete(f"/v1/checkpoints/{rec['id']}")),
    )
    if rec.get("reference") and rec["transport"] == "registry":
        image = ("registry image", lambda: ctx.agent(tgt).post("/v1/registry/delete", {"reference": rec["reference"]}))
        steps += (image,)
    best_effort(rec, steps)


def best_effort(rec: Record, steps: tuple[tuple[str, Callable[[], object]], ...]) -> None:
    """Run a cleanup's steps: each one's failure is a warning in the record, and the next still runs."""
    warnings: list[str] = []
    for what, fn in steps:
        try:
            fn()
        except PodmigrateError as e:
            warnings.append(f"{what}: {e.message}")
    if warnings:
        rec["cleanup_warnings"] = warnings


def state_checks(before: dict[str, Any], after: dict[str, Any]) -> dict[str, bool]:
    """What says a copy kept the workload's state: the same heap, the same process, the counter not back."""
    return {
        "sha256_equal": after.get("sha256") == before.get("sha256"),
        "counter_not_backwards": after.get("counter", -1) >= before.get("counter", 0),
        "same_process_start": after.get("started") == before.get("started"),
    }
