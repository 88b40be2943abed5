"""The lab's migration controller: a request in, one migration run by ``engine.runner``, a record out.

Neighbours: ``engine.plans`` (the phases each migration runs), ``engine.phases`` (their code),
``engine.runner`` (running, undoing, resuming), ``engine.record`` (the record and its SQLite store),
``engine.summary`` (the headline figures). The CLI, the demo and the benchmarks call ``migrate``;
every migrate command first runs ``recover``, which finishes what a dead controller left: an
interrupted rollback, a migration past its commit (finished forward), or one before it (rolled back).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from podmigrate import cordon, procs, transport
from podmigrate.claims import Claims
from podmigrate.engine import parking, paths, plans, summary
from podmigrate.engine.cluster import Cluster
from podmigrate.engine.phases import PROBE_FROM, Ctx, Report, implementations
from podmigrate.engine.phases.traffic import release_target_memory, start_probe, stop_probe_quietly
from podmigrate.engine.phases.validate import parse_probe
from podmigrate.engine.plans import PhaseName
from podmigrate.engine.record import PhaseEntry, PlanDict, Record, Rollback, Store
from podmigrate.engine.runner import Phase, Runner, as_error
from podmigrate.engine.signals import Abandoned, interruptible
from podmigrate.errors import AgentError, MigrationFailed, PodmigrateError, UsageError
from podmigrate.transport.registry import repository_component

__all__ = [
    "DEFAULT_TRANSPORT",
    "MODES",
    "TRANSPORTS",
    "Plan",
    "migrate",
    "parse_probe",
    "recover",
    "restore",
    "store_for",
]

MODES = ("stop-copy", "decoupled", "lazy", "cold")
PARK = "park"  # not a way to another node: the checkpoint waits in the registry (engine.phases.parked)
# the transports' siblings (transport.TRANSPORTS); archive is podman's own --export / --import path
# with an agent-to-agent copy (a baseline)
TRANSPORTS = tuple(transport.TRANSPORTS)
DEFAULT_TRANSPORT = plans.DEFAULT_TRANSPORT
COMPRESSIONS = ("none", "gzip", "zstd")
SECURITY = ("on", "off")


@dataclass
class Plan:
    workload: str
    target: str
    mode: str = "stop-copy"
    transport: str = plans.DEFAULT_TRANSPORT
    compression: str = "none"  # registry transport: none (heaps do not compress), gzip, zstd
    tcp_established: bool = True
    # pods: checkpoint only these members; the others start fresh on the target (severs their loopback
    # connections with the checkpointed ones: the study's single-container finding). Empty: all.
    only: tuple[str, ...] = ()
    probe: str | None = None  # "http:PORT/PATH" or "tcp:PORT"; default: the container's labels
    probe_interval: float = 0.02
    verify_timeout: float = 120.0
    drain_timeout: float = 2.0  # decoupled with a draining router: connections open at the cutover
    # this migration's alone, for measuring (bench engine): off leaves its checkpoint unsealed and
    # its pages without TLS; old_paths takes engine.paths' old paths. Other migrations keep theirs.
    security: str = "on"
    old_paths: tuple[str, ...] = ()
    # after a lazy restore: "after" collapses the copy's memory back into huge pages in the target
    # agent's background; "deferred" leaves it to the caller (an evacuation, once the node is empty)
    huge_pages: str = "after"


def store_for(lab: Cluster) -> Store:
    return Store(lab.dir / "state.db")


class LabRunner(Runner[Ctx]):
    """The runner with the lab's record store, progress lines and agent retries."""

    patience = 60.0  # an unreachable agent is usually one the lab is restarting
    artifact_patience = 20.0  # for what only takes disk space, once the workload is safe
    retry_delay = 1.0

    def row(self) -> plans.Row:
        rec = self.ctx.rec
        return plans.row(rec.get("scope", "container"), rec["mode"], rec["transport"])

    def implementations(self) -> Mapping[PhaseName, Phase[Ctx]]:
        return implementations(self.ctx.rec.get("scope", "container"), self.ctx.rec["mode"])

    def save(self, event: str) -> None:
        if event == "start" and self.ctx.rec["phase"] == PhaseName.VALIDATE:
            return  # a rejected request leaves no record behind
        super().save(event)

    def started(self, phase: Phase[Ctx], entry: PhaseEntry) -> None:
        if phase.name in PROBE_FROM:
            start_probe(self.ctx)
            entry["started"] = time.time()
            self.save("start")  # with the probe's id: a controller dying now leaves a recoverer to stop it

    def after(self, phase: Phase[Ctx], took: float) -> None:
        self.ctx.report(f"✓ {phase.name.value:<10} {took:7.3f} s")

    def failing(self, phase: Phase[Ctx], err: PodmigrateError) -> None:
        self.ctx.report(f"✗ {phase.name.value}: {err.message}")
        if phase.name is not PhaseName.VALIDATE:
            stop_probe_quietly(self.ctx)

    def rejected(self, e: Exception) -> None:
        raise e

    def past_commit(self, phase: Phase[Ctx], err: PodmigrateError) -> bool:
        # lazy: nothing to roll back to, the source only lives until its pages moved
        self.rec["status"] = "failed"
        self.rec["hint"] = "the copy on the target is the only one; check it, then run `podmigrate gc`"
        return False

    def undo(self, phase: Phase[Ctx]) -> str:
        """Keep trying an undo that protects the workload (not a mere artifact deletion) while its
        agent is unreachable, for ``patience`` seconds, before giving up."""
        return self._retrying(phase, 0 if phase.artifact else self.patience)

    def undo_again(self, phase: Phase[Ctx]) -> str:
        """An artifact left because its agent was unreachable: retried for ``artifact_patience`` (the
        lab restarts a dead agent in seconds), never before the workload itself is safe."""
        # any error: a registry that was down (and refused the delete) is back in seconds as well
        return self._retrying(phase, self.artifact_patience, PodmigrateError)

    def _retrying(self, phase: Phase[Ctx], patience: float, retry_on: type[PodmigrateError] = AgentError) -> str:
        assert phase.undo is not None
        deadline = time.monotonic() + patience
        while True:
            try:
                return phase.undo(self.ctx)
            except retry_on as e:
                if time.monotonic() > deadline:
                    raise
                self.ctx.report(f"… undo {phase.name.value}: {e.message}; retrying")
                time.sleep(self.retry_delay)

    def undone(self, phase: Phase[Ctx], result: Rollback) -> None:
        if result["ok"]:
            self.ctx.report(f"↶ {phase.name.value:<10} {result['did']}")
        else:
            self.ctx.report(f"✗ undo {phase.name.value}: {result['error']}")

    def after_rollback(self) -> None:
        release_target_memory(self.ctx)


def new_record(plan: Plan, lab: Cluster) -> Record:
    """A migration's record before its first phase; its checkpoint image's name where it goes
    through the registry (only then does the cluster need one)."""
    mid = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    transport = {"cold": "none", "lazy": "stream", PARK: "registry"}.get(plan.mode, plan.transport)
    rec: Record = {
        "id": mid,
        "workload": plan.workload,
        "container": plan.workload,
        "source": None,
        "target": plan.target,
        "mode": plan.mode,
        "transport": transport,
        "status": "running",
        "phase": None,
        "phases": [],
        "done": [],
        "rollbacks": [],
        "created": time.time(),
        "controller_pid": os.getpid(),
        "controller_start": procs.start_time(os.getpid()),
        "plan": cast(PlanDict, plan.__dict__.copy()),
    }
    if transport == "registry":
        rec["reference"] = f"{lab.registry}/podmigrate/checkpoints/{repository_component(plan.workload)}:{mid}"
    return rec


def check_request(lab: Cluster, plan: Plan) -> None:
    if plan.mode == PARK:
        lab.require_up()
        return
    if plan.mode not in MODES:
        raise UsageError(f"unknown mode {plan.mode!r}", hint=f"modes: {', '.join(MODES)}")
    if plan.compression not in COMPRESSIONS:
        raise UsageError(f"unknown compression {plan.compression!r}", hint="use none, gzip or zstd")
    if plan.compression != "none" and plan.transport != "registry":
        raise UsageError("compression applies to the registry transport only", hint="add --transport registry")
    if plan.mode != "cold" and plan.transport not in TRANSPORTS:  # cold moves no checkpoint
        raise UsageError(f"unknown transport {plan.transport!r}", hint=f"transports: {', '.join(TRANSPORTS)}")
    if plan.security not in SECURITY:
        raise UsageError(f"security is on or off, not {plan.security!r}")
    if plan.huge_pages not in ("after", "deferred"):
        raise UsageError(f"huge pages are collapsed after or deferred, not {plan.huge_pages!r}")
    paths.parse(",".join(plan.old_paths))
    lab.require_up()
    if plan.target not in lab.nodes:
        raise UsageError(
            f"there is no node {plan.target!r} in lab {lab.name!r}", hint=f"its nodes are: {', '.join(lab.nodes)}"
        )
    cordon.refuse_if_cordoned(lab, plan.target, "migrating a workload")


def migrate(lab: Cluster, plan: Plan, report: Report = lambda _m: None) -> Record:
    """Run one migration; returns its record, or raises MigrationFailed after rolling back."""
    check_request(lab, plan)
    return _run(lab, new_record(plan, lab), report)


def park(lab: Cluster, workload: str, report: Report = lambda _m: None) -> Record:
    """Checkpoint ``workload`` into the registry and leave it there, for ``restore``."""
    return migrate(lab, Plan(workload, "", PARK, "registry"), report)


def restore(lab: Cluster, workload: str, target: str, report: Report = lambda _m: None) -> Record:
    """Restore a parked ``workload`` on ``target``, its state checked against the parked one; a
    failure leaves it parked."""
    entry, key = parking.load(lab, workload)
    # the parked image is opened as it was sealed: with the key the park kept, or without one
    plan = Plan(workload, target, "stop-copy", "registry", security="on" if key else "off")
    check_request(lab, plan)
    rec = new_record(plan, lab)
    rec["scope"] = "parked"
    rec["checkpoint_id"] = entry["checkpoint_id"]
    rec["reference"] = entry["reference"]
    rec["checkpoint_image"] = entry["checkpoint_image"]
    rec["parked"] = entry
    return _run(lab, rec, report, key)


def _run(lab: Cluster, record: Record, report: Report, key: str | None = None) -> Record:
    plan = record["plan"]
    store = store_for(lab)
    recover(lab, store, report)
    for other in store.active():
        if other["workload"] == plan["workload"]:
            raise UsageError(
                f"{plan['workload']!r} is already being migrated ({other['id']}, pid {other['controller_pid']})",
                hint="wait for it to finish",
            )
    ctx = Ctx(lab, store, record, report, seal_key=key)
    claims = Claims(lab.dir)
    try:
        claims.take(plan["workload"], ctx.rec["id"])  # atomic: the check above alone races another migrate
    except UsageError:
        ctx.close()
        raise
    try:
        runner = LabRunner(ctx, ctx.rec, store)
        rec = ctx.rec
        try:
            with interruptible(rec, report, runner.committed):
                runner.run()
        except Abandoned as e:
            undone = [r["phase"] for r in rec["rollbacks"] if r.get("ok")]
            if rec["status"] != "rolling_back":
                raise MigrationFailed(
                    f"migration {rec['id']} of {rec['workload']!r} was stopped past its commit by a second {e}, "
                    f"in phase {rec['phase']}; the target {rec.get('target')} holds the workload",
                    hint="`podmigrate gc` finishes the migration from the saved record (so does the next migrate)",
                    details={"record": rec},
                ) from None
            raise MigrationFailed(
                f"the rollback of migration {rec['id']} of {rec['workload']!r} was stopped by a second {e}; "
                f"undone so far: {', '.join(undone) or 'nothing'}; the workload may still be frozen on "
                f"{rec.get('source') or 'its node'}",
                hint="`podmigrate gc` finishes the rollback from the saved record (so does the next migrate)",
                details={"record": rec},
            ) from None
        if rec["status"] == "completed":
            summary.summarize(rec)
            store.save(rec)
            return rec
        store.save(rec)
        err = as_error(runner.error or PodmigrateError("the migration stopped"))
        where = "is still parked" if rec.get("scope") == "parked" else f"runs on {rec.get('source') or 'its node'}"
        raise MigrationFailed(
            f"migration {rec['id']} of {rec['workload']!r} failed in phase {rec['phase']}: {err.message}; "
            + ("rolled back, it " + where if rec["status"] == "rolled_back" else "ROLLBACK FAILED: see the record"),
            hint=err.hint,
            details={"record": rec, **err.details},
        ) from runner.error
    finally:
        claims.release(plan["workload"], ctx.rec["id"])
        ctx.close()


def recover(lab: Cluster, store: Store, report: Report = lambda _m: None) -> list[Record]:
    """Finish what dead controllers left (see ``engine.plans`` for the policy); the records."""
    done: list[Record] = []
    running = {mid for mid, _ in Claims(lab.dir).busy().values()}
    for rec in store.active():
        if rec["id"] in running:
            continue  # its controller holds the claim: alive, perhaps a thread of this very process
        pid, start = rec.get("controller_pid"), rec.get("controller_start")
        if pid and pid != os.getpid() and start is not None and procs.alive(procs.Proc(pid, start)):
            continue
        report(f"recovering migration {rec['id']} left in phase {rec['phase']} by a dead controller")
        ctx = Ctx(lab, store, rec, report)
        try:
            LabRunner(ctx, rec, store).resume()
            rec["recovered_at"] = time.time()
            store.save(rec)
            done.append(rec)
        finally:
            # the dead controller's probe would go on for its full lease (30 min, dozens of threads
            # on the LAN agent, connecting to an address that may be gone): stopped whatever the end
            stop_probe_quietly(ctx)
            ctx.close()
    return done
