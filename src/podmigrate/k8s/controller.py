"""One PodLiveMigration, run by ``engine.runner`` with its record kept in the resource's status.

The lab controller's design (``engine.controller``) with Kubernetes backends; the phases per mode are
the ``kubernetes`` rows of ``engine.plans``, their code is ``k8s.validate`` and ``k8s.phases``.
The record (``status.record``, ``k8s.context.K8sRecord``) is written after every step, so a
restarted operator resumes: phases done are skipped, the one that was running is run again (each
``do`` is idempotent); an operator that died while it rolled back finishes the rollback. A failure
before the cutover, or a deletion of the resource mid-way, undoes every phase that started, newest
first: ``RolledBack`` (``Failed`` when an undo failed too, or the spec was invalid). Past the
cutover a failure is a warning and the migration finishes. ``k8s.operator`` calls ``run`` and
``rollback``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from podmigrate.engine import plans
from podmigrate.engine.plans import PhaseName
from podmigrate.engine.record import FINISHED
from podmigrate.engine.runner import Phase, Runner, as_error
from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s.agents import AGENT_LABELS, Agents, Config
from podmigrate.k8s.context import LOCK, Cancelled, Ctx, Event, K8sRecord
from podmigrate.k8s.crd import SpecError, validate_spec
from podmigrate.k8s.phases import PHASES

__all__ = ["AGENT_LABELS", "FINISHED", "Agents", "Cancelled", "Config", "Ctx", "Event", "Transient", "rollback", "run"]

PUBLIC_PHASE = {
    "validate": "Pending",
    "page-server": "Pending",  # stream: the copy is made ready to receive; the source is untouched yet
    "isolate": "Checkpointing",
    "stop": "Checkpointing",
    "checkpoint": "Checkpointing",
    "package": "Transferring",
    "restore": "Restoring",
    "cutover": "CuttingOver",
    "pages": "CuttingOver",  # lazy: the copy serves, its memory still arriving
    "cleanup": "CuttingOver",
}
# who runs a migration: a container restart keeps the hostname and PID 1, so a random token per process
OWNER = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


class Transient(PodmigrateError):
    """A failure before anything changed that a retry may not meet (API or agent briefly unreachable)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message[:1000],
        "lastTransitionTime": _now(),
    }


def _timings(rec: K8sRecord) -> dict[str, float]:
    return {p["name"]: round(p["ended"] - p["started"], 3) for p in rec["phases"] if p.get("ended")}


class K8sRunner(Runner[Ctx]):
    """The runner with the resource's status as its store, Events, and Kubernetes' outcomes."""

    def row(self) -> plans.Row:
        mode = self.ctx.spec.get("mode", "decoupled")
        transport = "none" if mode == "cold" else "stream" if mode == "lazy" else self.ctx.spec.get("transport")
        return plans.row("kubernetes", mode, transport or "registry")

    def implementations(self) -> Mapping[PhaseName, Phase[Ctx]]:
        return PHASES

    def status(self, event: str) -> dict[str, Any]:
        rec = self.ctx.rec
        name = rec.get("phase") or "validate"
        if event == "start":
            running = f"{name} running"
            return {
                "phase": PUBLIC_PHASE[name],
                "message": running,
                "conditions": [_condition("Progressing", True, name.capitalize(), running)],
            }
        if event == "end":
            return {
                "phase": PUBLIC_PHASE[name],
                "sourceNode": rec.get("source"),
                "targetNode": rec.get("target"),
                "phaseTimings": _timings(rec),
            }
        return {}

    def save(self, event: str) -> None:
        if event in ("start", "end"):
            super().save(event)
            return
        with contextlib.suppress(PodmigrateError):  # the object may be gone (a cancelled migration);
            super().save(event)  # the undo itself matters more

    def before(self, phase: Phase[Ctx]) -> None:
        if phase.name is not PhaseName.VALIDATE and not self.committed():
            self.ctx.check_cancelled()

    def after(self, phase: Phase[Ctx], took: float) -> None:
        ctx, rec, name = self.ctx, self.ctx.rec, phase.name.value
        ctx.on_phase(name, took)
        note = ""
        if name == "validate":
            note = f": {rec['source']} -> {rec['target']}"
        elif name == "package":
            note = f": {rec.get('bytes', 0)} bytes pushed"
        ctx.event("Normal", name.capitalize(), f"{name} done in {took:.3f} s{note}")

    def rejected(self, e: Exception) -> None:
        rec = self.ctx.rec
        if not isinstance(e, SpecError):
            # nothing changed yet and nothing is wrong with the spec: let the operator retry later
            err = as_error(e)
            rec["phases"] = [p for p in rec["phases"] if p["name"] != "validate"]
            raise Transient(f"validate: {err.message}", hint=err.hint) from e
        rec["error"] = PodmigrateError(str(e), hint=getattr(e, "hint", None)).to_wire()
        rec["status"] = "failed"
        _unlock(self.ctx)
        self.outcome(e.reason, str(e))

    def past_commit(self, phase: Phase[Ctx], err: PodmigrateError) -> bool:
        return True  # the copy serves: finish forward, the failure is a warning

    def after_rollback(self) -> None:
        _unlock(self.ctx)

    def failed(self) -> None:
        """Say how a rollback ended: an Event and the resource's status."""
        rec = self.ctx.rec
        ok = rec["status"] == "rolled_back"
        reason = "RolledBack" if ok else "RollbackFailed"
        where = rec.get("source") or "its node"
        message = f"{rec.get('phase') or 'validate'} failed: {rec.get('error', {}).get('message', '')}; " + (
            f"rolled back, {self.ctx.spec.get('podName')} runs on {where}"
            if ok
            else "ROLLBACK FAILED: see status.record"
        )
        if rec.get("leftovers"):
            gone = "; ".join(f"{x['phase']}: {x['error']}" for x in rec["leftovers"])
            message += "; could not delete (run the agents' gc): " + gone
        if isinstance(self.error, Cancelled) and self.ctx.plm() is None:
            self.ctx.event("Warning", reason, message)
            return  # nothing left to write the outcome to
        self.outcome(reason, message)

    def outcome(self, reason: str, message: str) -> None:
        rec = self.ctx.rec
        self.ctx.event("Warning", reason, message)
        self.ctx.save(
            phase="RolledBack" if rec["status"] == "rolled_back" else "Failed",
            reason=reason,
            message=message,
            phaseTimings=_timings(rec),
            completedAt=_now(),
            conditions=[
                _condition("Progressing", False, reason, message),
                _condition("Succeeded", False, reason, message),
            ],
        )

    def completed(self) -> None:
        ctx, rec, spec = self.ctx, self.ctx.rec, self.ctx.spec
        stopped = [rec[k] for k in ("isolated_at", "frozen_at") if k in rec]  # whichever came first
        blackout = rec["cutover_at"] - min(stopped) if stopped else 0.0
        drift = rec["cutover_at"] - rec["checkpointed_at"] if spec["mode"] == "decoupled" else 0.0
        rec["blackout_s"], rec["drift_s"] = blackout, drift
        msg = f"moved {spec['podName']} from {rec['source']} to {rec['target']} as {rec['restored']}"
        if rec.get("warnings"):
            msg += "; cleanup left: " + "; ".join(rec["warnings"])
        ctx.event("Normal" if not rec.get("warnings") else "Warning", "Completed", msg)
        ctx.save(
            phase="Completed",
            message=msg,
            restoredPod={"name": rec["restored"], "node": rec["target"]},
            checkpointImages=rec.get("images") or {},
            restorePath=rec.get("restore_path"),
            transport=rec.get("transport"),
            phaseTimings=_timings(rec),
            blackoutSeconds=round(blackout, 3),
            driftSeconds=round(drift, 3),
            bytes=int(rec.get("bytes", 0)),
            completedAt=_now(),
            conditions=[
                _condition("Progressing", False, "Completed", msg),
                _condition("Succeeded", True, "Completed", msg),
            ],
        )


def run(ctx: Ctx, stop_after: str | None = None) -> K8sRecord:
    """Run (or resume) the migration to a terminal phase (or only up to ``stop_after``)."""
    rec = ctx.rec
    if rec.get("status") in FINISHED:
        return rec
    runner = K8sRunner(ctx, rec, ctx.store)
    if rec["status"] == "rolling_back":  # the operator died while it rolled back: finish that
        ctx.spec = rec.get("spec") or ctx.spec
        runner.rollback()
        runner.failed()
        return rec
    if not rec["phases"]:
        rec["started"], rec["owner"] = time.time(), OWNER
        ctx.save(phase="Pending", startedAt=_now(), message="accepted")
    elif rec.get("owner") != OWNER:  # another operator process started it and died
        after = rec["done"][-1] if rec["done"] else "nothing"
        ctx.event("Normal", "Resumed", f"resuming after {after}; was {rec.get('owner')}")
        rec["owner"] = OWNER
    try:
        ctx.spec = rec.get("spec") or validate_spec(ctx.spec)
    except SpecError as e:
        rec["phase"] = "validate"
        runner.rejected(e)
        return rec
    runner.run(PhaseName(stop_after) if stop_after else None)
    if rec["status"] == "completed":
        runner.completed()
    elif rec["status"] in FINISHED and rec.get("phase") != "validate":
        runner.failed()
    return rec


def rollback(ctx: Ctx) -> bool:
    """Undo every phase that started, newest first (the resource was deleted while it ran)."""
    return K8sRunner(ctx, ctx.rec, ctx.store).rollback()


def _unlock(ctx: Ctx) -> None:
    try:
        pod = ctx.api.get(k.pods(ctx.ns, ctx.spec.get("podName", "")))
        if pod and (pod["metadata"].get("annotations") or {}).get(LOCK) == ctx.name:
            ctx.api.patch(k.pods(ctx.ns, ctx.spec["podName"]), {"metadata": {"annotations": {LOCK: None}}})
    except PodmigrateError:
        pass  # a stale lock names a finished migration, which the next validate ignores
