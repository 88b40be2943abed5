"""The runner: one migration as ordered phases with undos, its record saved after every step.

One implementation for both controllers. ``engine.plans`` says which phases run, after which one
the migration is committed, and what becomes of a migration a dead controller left; the phases
themselves are in ``engine.phases`` (lab) and ``k8s.phases`` (Kubernetes). ``engine.controller`` and
``k8s.controller`` subclass ``Runner`` with only what differs: where the record goes
(``RecordStore``), how progress is shown, how a rejected request is answered.

The rules, in one place:
- each phase's ``do`` runs once; the record is saved when it starts and when it ends;
- a failure before the commit undoes every phase that started, newest first, saving after each
  undo under status ``rolling_back``, so that a controller that dies half-way leaves a rollback
  for the next one to finish (a successful undo is never run twice);
- an undo that only deletes a copy (``artifact``) and fails leaves a leftover, the workload is safe;
  any other failed undo makes the status ``failed``: the workload's placement is uncertain;
- after the commit nothing is undone: a failure is finished forward or stops, as the controller
  says (``past_commit``);
- ``resume`` takes over a migration a dead controller left, following the row's policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from podmigrate.engine.plans import PhaseName, Resume, Row
from podmigrate.engine.record import PhaseEntry, RecordStore, Rollback, RunRecord
from podmigrate.errors import PodmigrateError

C = TypeVar("C")


@dataclass(frozen=True)
class Phase(Generic[C]):
    name: PhaseName
    do: Callable[[C], None]
    undo: Callable[[C], str] | None = None  # works from the record alone (a later process runs it); idempotent
    artifact: bool = False  # its undo only deletes a copy: a failed undo leaves a leftover, not a risk


def as_error(e: BaseException) -> PodmigrateError:
    return e if isinstance(e, PodmigrateError) else PodmigrateError(f"{type(e).__name__}: {e}")


class Runner(Generic[C]):
    """Runs, rolls back and resumes one migration; subclasses say where and how it shows."""

    def __init__(self, ctx: C, rec: RunRecord, store: RecordStore):
        self.ctx = ctx
        self.rec = rec
        self.store = store
        self.error: BaseException | None = None  # the failure that stopped the last run, as raised
        rec.setdefault("status", "running")
        rec.setdefault("phases", [])
        rec.setdefault("rollbacks", [])
        rec.setdefault("done", [p["name"] for p in rec["phases"] if p.get("ok")])

    # ---------------------------------------------------------------- what a controller provides
    def row(self) -> Row:
        raise NotImplementedError

    def implementations(self) -> Mapping[PhaseName, Phase[C]]:
        raise NotImplementedError

    def save(self, event: str) -> None:
        """Persist the record at ``event``: start, end (of ``rec['phase']``), undo, outcome."""
        self.store.save(self.rec, **self.status(event))

    def status(self, event: str) -> dict[str, Any]:
        """What the store shows beside the record at ``event`` (Kubernetes: the public status)."""
        return {}

    def before(self, phase: Phase[C]) -> None:
        """Called just before a phase starts (a cancelled migration raises here)."""

    def started(self, phase: Phase[C], entry: PhaseEntry) -> None:
        """Called once a phase's start is saved, just before its ``do``."""

    def after(self, phase: Phase[C], took: float) -> None:
        """Called once a phase succeeded."""

    def failing(self, phase: Phase[C], err: PodmigrateError) -> None:
        """Called first when a phase failed, before anything is undone."""

    def undo(self, phase: Phase[C]) -> str:
        assert phase.undo is not None
        return phase.undo(self.ctx)

    def undone(self, phase: Phase[C], result: Rollback) -> None:
        """Called after each undo, successful or not."""

    def after_rollback(self) -> None:
        """Called once every undo ran (release what the migration held: memory, a lock)."""

    def undo_again(self, phase: Phase[C]) -> str:
        """A second try of an artifact's undo that failed, once every other undo ran; its error is a leftover."""
        return self.undo(phase)

    def rejected(self, e: Exception) -> None:
        """Validate failed: nothing changed. The default marks the migration failed."""
        self.rec["status"] = "failed"

    def past_commit(self, phase: Phase[C], err: PodmigrateError) -> bool:
        """A phase after the commit failed; True finishes forward (the failure becomes a warning),
        False stops with status ``failed``."""
        self.rec["status"] = "failed"
        return False

    # ---------------------------------------------------------------------------------- running
    def phases(self) -> list[Phase[C]]:
        impls = self.implementations()
        return [impls[n] for n in self.row().phases]

    def committed(self) -> bool:
        return self.row().commit.value in self.rec["done"]

    def pending(self) -> Phase[C] | None:
        # asked anew after every phase: what moves (a container or a whole pod) may be known only
        # once validate ran
        return next((p for p in self.phases() if p.name.value not in self.rec["done"]), None)

    def run(self, stop_after: PhaseName | None = None) -> RunRecord:
        """Run every phase not done yet (or up to ``stop_after``); a failure is rolled back or,
        past the commit, handled by ``past_commit``. The record's status says how it ended."""
        rec = self.rec
        while (phase := self.pending()) is not None:
            try:
                self._run_one(phase)
            except Exception as e:
                self.error = e
                if not self._failed(phase, e):
                    return rec
            if phase.name == stop_after:
                return rec
        rec["status"] = "completed"
        return rec

    def _run_one(self, phase: Phase[C]) -> None:
        rec = self.rec
        self.before(phase)
        entry: PhaseEntry = {"name": phase.name.value, "started": time.time(), "ok": False}
        rec["phases"] = [p for p in rec["phases"] if p["name"] != phase.name.value] + [entry]
        rec["phase"] = phase.name.value
        self.save("start")
        self.started(phase, entry)
        phase.do(self.ctx)
        entry["ended"] = time.time()
        entry["ok"] = True
        rec["done"].append(phase.name.value)
        self.save("end")
        self.after(phase, entry["ended"] - entry["started"])

    def _failed(self, phase: Phase[C], e: Exception) -> bool:
        """Handle a failed phase; True when the run goes on."""
        rec = self.rec
        err = as_error(e)
        if rec["phases"] and rec["phases"][-1]["name"] == phase.name.value:
            rec["phases"][-1].setdefault("ended", time.time())
        self.failing(phase, err)
        if phase.name is PhaseName.VALIDATE:
            rec["error"] = err.to_wire()
            self.rejected(e)
            return False
        if self.committed():
            rec.setdefault("warnings", []).append(f"{phase.name.value}: {err.message}")
            if self.past_commit(phase, err):
                rec["done"].append(phase.name.value)
                return True
            rec["error"] = err.to_wire()
            self.save("outcome")
            return False
        rec["error"] = err.to_wire()
        self.rollback()
        return False

    # ------------------------------------------------------------------------------- undoing
    def rollback(self) -> bool:
        """Undo every phase that started, newest first; True when the workload is back where it was."""
        rec = self.rec
        rec["status"] = "rolling_back"
        self.save("undo")
        impls = {p.name.value: p for p in self.phases()}
        ok = True
        again: list[Phase[C]] = []
        for entry in reversed(rec["phases"]):
            phase = impls.get(entry["name"])
            if phase is None or phase.undo is None:
                continue
            undone = {r["phase"] for r in rec["rollbacks"] if r.get("ok")}
            if phase.name.value in undone:
                continue  # a resumed rollback: done before the last controller died
            result: Rollback
            try:
                result = {"phase": phase.name.value, "ok": True, "did": self.undo(phase), "at": time.time()}
            except Exception as e:  # keep undoing the rest: each undo protects something else
                msg = as_error(e).message
                result = {"phase": phase.name.value, "ok": False, "error": msg, "at": time.time()}
                if phase.artifact:
                    again.append(phase)
                else:
                    ok = False
            rec["rollbacks"].append(result)
            self.undone(phase, result)
            self.save("undo")
        for phase in again:  # the workload is safe by now: a restarting agent gets time to clean up
            try:
                result = {"phase": phase.name.value, "ok": True, "did": self.undo_again(phase), "at": time.time()}
            except Exception as e:
                msg = as_error(e).message
                rec.setdefault("leftovers", []).append({"phase": phase.name.value, "error": msg})
                continue
            rec["rollbacks"].append(result)
            self.undone(phase, result)
            self.save("undo")
        self.after_rollback()
        rec["status"] = "rolled_back" if ok else "failed"
        return ok

    def resume(self) -> RunRecord:
        """Take over a migration a dead controller left: an interrupted rollback is finished; past
        the commit, the migration is finished forward; before it, the row's policy decides."""
        rec = self.rec
        if rec["status"] == "rolling_back":
            self.rollback()
        elif self.committed() or self.row().resume is Resume.RERUN:
            self.run()
        else:
            rec.setdefault("error", {"kind": "PodmigrateError", "message": "its controller died"})
            self.rollback()
        return rec


def phase_table(*phases: Phase[Any]) -> dict[PhaseName, Phase[Any]]:
    return {p.name: p for p in phases}
