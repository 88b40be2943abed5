"""Empty a node before its deadline (``podmigrate evacuate``, a Spot notice): survey, plan, run, re-plan.

The node is cordoned first (no workload starts or lands there again), then every running workload on
it (containers, and pods as one) is surveyed: its resident memory, the targets' free memory and disk
as their agents report them, the rates this lab's past migrations measured (``engine.rates``) and
how much slower each of several concurrent migrations runs (``slowdowns``: from past evacuations, a
default until there are some), read by ``engine.survey``. ``engine.schedule`` plans from that; this
module runs the plan, that many migrations at once, each one the engine's own ``controller.migrate``
in a thread (its claims, rollback and record are the single migration's). A migration that fails has
rolled back (the workload serves on its node again); if its target failed (a target-side phase, or
its agent stopped answering) that target takes no more workloads and everything not yet started is
planned again on the others, with the time that is left; otherwise it is tried once more another
way. Nothing is lost silently: every workload ends moved, parked in the registry (``podmigrate
restore`` brings it back), restarted (state lost, said so), or not moved with the reason.
A SIGINT or SIGTERM starts no more migrations and lets the running ones finish (a migration cut
short would roll back, not evacuate). The record (``<lab>/evacuations/<id>.json``) keeps the plan,
every re-plan and per workload what happened; past records teach ``slowdowns``.
"""

from __future__ import annotations

import json
import secrets
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from podmigrate import cordon
from podmigrate.engine import rates as rates_mod
from podmigrate.engine import schedule
from podmigrate.engine.cluster import Cluster
from podmigrate.engine.controller import DEFAULT_TRANSPORT, Plan, store_for
from podmigrate.engine.controller import migrate as run_migration
from podmigrate.engine.phases import Report, lazy
from podmigrate.engine.record import Record
from podmigrate.engine.schedule import EvacuationPlan, Factor, Rate, Step, Target, Workload
from podmigrate.engine.survey import exclusive, records_dir, slowdowns, survey, targets
from podmigrate.errors import PodmigrateError, UsageError

Migrate = Callable[[Cluster, Plan, Report], Record]
RESERVE = 0.15  # every step planned to end this fraction before the deadline
TARGET_PHASES = {"page-server", "transfer", "pull", "restore", "start", "pages"}


@dataclass
class Outcome:
    """One workload's evacuation, as the progress display and the end table show it."""

    workload: str
    kind: str
    memory: int
    source: str
    pod: str | None = None
    status: str = "waiting"  # waiting | running | moved | parked | restarted | failed | lost
    doing: str = ""
    mode: str | None = None
    transport: str | None = None
    target: str | None = None
    migration: str | None = None
    attempts: int = 0
    started_at_s: float | None = None
    finished_at_s: float | None = None
    predicted_s: float | None = None  # alone, before slowdown: what ``slowdowns`` learns from
    took_s: float | None = None
    blackout_s: float | None = None
    bytes_moved: int | None = None
    state: str | None = None  # kept | lost (from the migration's own check)
    why: str = ""

    @property
    def label(self) -> str:
        return f"pod {self.pod}" if self.pod else self.workload


@contextmanager
def _gentle_signals(on_signal: Callable[[str], None]) -> Iterator[None]:
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        on_signal(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Evacuation:
    """Plan (``plan``) and run (``run``) the evacuation of ``node`` within ``deadline_s`` seconds."""

    def __init__(
        self,
        lab: Cluster,
        node: str,
        deadline_s: float = 120.0,
        to: list[str] | None = None,
        parallel: int | None = None,
        report: Report = lambda _m: None,
        progress: Callable[[Evacuation], None] = lambda _e: None,
        migrate: Migrate = run_migration,
    ):
        if deadline_s <= 0:
            raise UsageError(f"the deadline must be in the future, not {deadline_s} s", hint="give --deadline SECONDS")
        unknown = sorted(set(to or []) - set(lab.nodes))
        if unknown or node in (to or []):
            raise UsageError(
                f"cannot evacuate {node} to {', '.join(unknown) or node}: "
                + ("no such node" if unknown else "it is the node being emptied"),
                hint=f"the lab's nodes are: {', '.join(lab.nodes)}",
            )
        self.lab, self.node, self.deadline_s = lab, node, deadline_s
        self.to = [n for n in (to or lab.nodes) if n != node]
        self.forced = parallel
        self.report, self.progress, self.migrate = report, progress, migrate
        self.id = "ev-" + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        self.t0 = time.monotonic()
        self.outcomes: dict[str, Outcome] = {}
        self.failed_targets: dict[str, str] = {}
        self.replans: list[dict[str, Any]] = []
        self.stopping: str | None = None
        self.rates: dict[str, Rate] = {}
        self.slow: dict[int, Factor] = {}
        self.slow_basis = ""
        self.first: EvacuationPlan | None = None
        self.collapse_later: list[tuple[str, str]] = []  # (target, container): lazy copies moved here

    # ----------------------------------------------------------------------------- planning
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def plan(self) -> EvacuationPlan:
        """Survey and plan; nothing changes (``--dry-run`` stops here)."""
        with ThreadPoolExecutor(1, "targets") as pool:  # the node's workloads and the targets' room at once
            found = pool.submit(targets, self.lab, self._usable())
            workloads = survey(self.lab, self.node)
            self.rates = rates_mod.learn(store_for(self.lab).list(limit=500))
            self.slow, self.slow_basis = slowdowns(self.lab, self.rates)
            if self.forced:
                self.slow = {self.forced: self.slow.get(self.forced, 1.0 + 0.5 * (self.forced - 1))}
            for w in workloads:
                self.outcomes.setdefault(w.name, Outcome(w.name, w.kind, w.memory, w.source, w.pod))
            self.first = self._plan(workloads, self.deadline_s, self.slow, found=found.result())
        return self.first

    def _usable(self) -> list[str]:
        return [n for n in self.to if n not in self.failed_targets and n not in cordon.cordoned(self.lab)]

    def _plan(
        self,
        ws: list[Workload],
        left_s: float,
        slow: dict[int, Factor],
        skip: AbstractSet[str] = frozenset(),
        found: tuple[list[Target], dict[str, str]] | None = None,
    ) -> EvacuationPlan:
        ts, down = found or targets(self.lab, self._usable())
        for n, why in down.items():
            self.failed_targets[n] = f"its agent does not answer: {why}"
        rates = {k: r for k, r in self.rates.items() if k not in skip and k != rates_mod.PARK}
        park = None if rates_mod.PARK in skip else self.rates.get(rates_mod.PARK)
        return schedule.plan(ws, ts, rates, left_s, slow, park, self.rates.get(rates_mod.COLD), RESERVE)

    def _replan(self, ws: list[Workload], why: str, skip: AbstractSet[str] = frozenset()) -> list[Step]:
        now = self.elapsed()
        k = self.parallel
        p = self._plan(ws, self.deadline_s - now, {k: self.slow.get(k, 1.0)}, skip)
        for s in p.steps:
            s.start_s, s.end_s = s.start_s + now, s.end_s + now
        self.replans.append({"at_s": round(now, 3), "why": why, "plan": p.to_dict()})
        self.report(f"re-planned at T+{now:.1f} s: {why}")
        return p.steps

    @property
    def parallel(self) -> int:
        return self.first.parallel if self.first else 1

    # ------------------------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        """Cordon, plan, move; the evacuation's record (also saved under ``<lab>/evacuations``)."""
        with exclusive(self.lab, self.node):
            cordon.cordon(self.lab, self.node, f"evacuated by {self.id}")
            first = self.plan()
            self.report(f"plan: {len(first.steps)} workloads, {first.parallel} at a time, "
                        f"predicted empty at T+{first.end_s:.1f} s of {self.deadline_s:.0f} s")  # fmt: skip
            with _gentle_signals(self._stop), ThreadPoolExecutor(max(1, first.parallel), "evacuate") as pool:
                self._loop(pool, list(first.steps))
            return self._finish()

    def _stop(self, name: str) -> None:
        if self.stopping:
            raise KeyboardInterrupt(name)  # a second one: leave the running ones to `podmigrate gc`
        self.stopping = name
        self.report(f"{name}: starting no more migrations; the running ones finish (send it again to leave them)")

    def _loop(self, pool: ThreadPoolExecutor, queue: list[Step]) -> None:
        running: dict[Future[Record], tuple[Step, Outcome]] = {}
        # what a plan gave up on is planned once more when a lane is free and nothing else waits, with
        # the time then left: the rates are medians, and faster moves than predicted leave time over
        deferred: list[Step] = []
        tried_again: set[str] = set()
        while queue or running or deferred:
            if deferred and not queue and len(running) < self.parallel and not self.stopping:
                ws = [self._workload(self.outcomes[d.workload]) for d in deferred]
                tried_again |= {d.workload for d in deferred}
                deferred = []
                queue = self._replan(ws, "planned as lost: tried again with the time left")
            while queue and len(running) < self.parallel and not self.stopping:
                step = queue.pop(0)
                o = self.outcomes[step.workload]
                if step.action == "lost":
                    o.status, o.why = "lost", step.why
                    if step.workload not in tried_again:
                        deferred.append(step)
                    continue
                if self.elapsed() + (step.end_s - step.start_s) > self.deadline_s:
                    queue = self._replan([self._workload(o)], f"{o.label} would end after the deadline") + queue
                    continue
                o.status, o.mode, o.transport, o.target = "running", step.mode, step.transport, step.target
                o.attempts += 1
                o.started_at_s, o.why = self.elapsed(), step.why
                o.predicted_s = self.rates[self._way(step)].total(step.memory)
                running[pool.submit(self._one, step, o)] = (step, o)
            self.progress(self)
            if not running:
                if deferred and not self.stopping:
                    continue
                break
            done, _ = wait(running, timeout=0.25, return_when=FIRST_COMPLETED)
            for f in done:
                step, o = running.pop(f)
                queue = self._settle(f, step, o, queue)
        for step in queue:
            o = self.outcomes[step.workload]
            o.status, o.why = "failed", f"not started: {self.stopping}; it still runs on {o.source}"
        self.progress(self)

    def _one(self, step: Step, o: Outcome) -> Record:
        def note(msg: str) -> None:
            o.doing = msg[:80]

        if step.action == "park":  # no node can take it in time: into the registry, for `podmigrate restore`
            return self.migrate(self.lab, Plan(step.workload, "", "park", "registry"), note)
        assert step.target and step.mode and step.transport
        transport = step.transport if step.mode != "cold" else DEFAULT_TRANSPORT
        # a lazy copy's huge pages come back once the node is empty (_finish): collapsing them costs
        # ~2 CPU-seconds per GB here (the kernel copies every page), which the next migrations need
        plan = Plan(step.workload, step.target, step.mode, transport, huge_pages="deferred")
        return self.migrate(self.lab, plan, note)

    def _settle(self, f: Future[Record], step: Step, o: Outcome, queue: list[Step]) -> list[Step]:
        o.finished_at_s = self.elapsed()
        o.took_s = o.finished_at_s - (o.started_at_s or 0.0)
        o.doing = ""
        err = f.exception()
        if err is None:
            done = f.result()
            if step.action == "park":
                o.status, o.target, o.migration = "parked", None, done["id"]
                o.why = f"{step.why}; `podmigrate restore {o.workload} --to NODE` brings it back"
                return queue
            o.status = "restarted" if step.mode == "cold" else "moved"
            o.migration, o.blackout_s = done["id"], done.get("blackout_s")
            if (done.get("huge_pages") or {}).get("state") == "deferred":
                self.collapse_later.append((done["target"], done["container"]))
            o.bytes_moved, o.state = done.get("bytes_moved"), done.get("state")
            return queue
        rec: dict[str, Any] = getattr(err, "details", {}).get("record") or {}
        o.migration = rec.get("id")
        message = err.message if isinstance(err, PodmigrateError) else repr(err)
        if step.action == "park":  # rolled back: it serves where it was, until the deadline stops it
            o.status, o.why = "failed", f"parking it failed: {message}"  # (which says where it runs)
            return queue
        assert step.target
        if rec.get("status") not in (None, "rolled_back"):
            o.status, o.why = "failed", f"{message} (its record {o.migration} says where it is)"
            return queue
        if rec.get("phase") in TARGET_PHASES or not targets(self.lab, [step.target])[0]:
            self.failed_targets[step.target] = f"{rec.get('phase') or 'a request'} failed: {message}"
            self.report(f"{step.target} failed ({message}); it takes no more workloads")
            rest = [self._workload(self.outcomes[s.workload]) for s in queue if s.action != "lost"]
            lost = [s for s in queue if s.action == "lost"]
            return self._replan([self._workload(o), *rest], f"{step.target} failed") + lost
        if o.attempts >= 2:
            o.status, o.why = "failed", f"{message}; rolled back, it still runs on {o.source}"
            return queue
        o.status = "waiting"
        return self._replan([self._workload(o)], f"{o.label}: {message}", skip={self._way(step)}) + queue

    @staticmethod
    def _way(step: Step) -> str:
        return rates_mod.COLD if step.mode == "cold" else f"{step.mode}/{step.transport}"

    @staticmethod
    def _workload(o: Outcome) -> Workload:
        return Workload(o.workload, o.memory, o.kind, o.pod, o.source)

    def _finish(self) -> dict[str, Any]:
        left = [w.pod or w.name for w in survey(self.lab, self.node)]
        moved = [o for o in self.outcomes.values() if o.status in ("moved", "restarted")]
        emptied = round(max((o.finished_at_s or 0.0 for o in moved), default=0.0), 3)
        blackouts = [o.blackout_s for o in moved if o.blackout_s is not None]
        assert self.first is not None
        rec = {
            "id": self.id,
            "node": self.node,
            "deadline_s": self.deadline_s,
            "parallel": self.parallel,
            "finished_at": time.time(),
            "empty": not left,
            "left_running": left,
            "time_to_empty_s": emptied,
            "median_blackout_s": round(statistics.median(blackouts), 3) if blackouts else None,
            "state_kept": sum(o.state == "kept" for o in moved),
            "parked": [o.workload for o in self.outcomes.values() if o.status == "parked"],
            "interrupted_by": self.stopping,
            "failed_targets": self.failed_targets,
            "rates": {k: r.basis for k, r in self.rates.items()},
            "slowdown": {"factors": self.slow, "basis": self.slow_basis},
            "plan": self.first.to_dict(),
            "replans": self.replans,
            "workloads": [asdict(o) | {"label": o.label} for o in self.outcomes.values()],
        }
        rec["met_deadline"] = not left and emptied <= self.deadline_s
        rec["huge_pages"] = self._collapse()
        path = records_dir(self.lab) / f"{self.id}.json"
        path.write_text(json.dumps(rec, indent=2, default=str) + "\n")
        return rec

    def _collapse(self) -> list[dict[str, Any]]:
        """The moved lazy copies' memory back into huge pages, now that nothing else is waiting: each in
        its target agent's background (``agent.collapses``; ``collapsed`` reads the outcome)."""
        out: list[dict[str, Any]] = []
        for target, container in self.collapse_later:
            entry: dict[str, Any] = {"target": target, "container": container}
            try:
                agent = self.lab.agent(target, timeout=10)
                try:
                    entry |= agent.post(f"/v1/containers/{container}/huge-pages", {"background": True})
                finally:
                    agent.close()
            except PodmigrateError as e:  # the copy serves either way
                entry |= {"state": "failed", "error": e.message[:300]}
            out.append(entry)
        return out


def collapsed(lab: Cluster, rec: dict[str, Any], timeout: float = 120.0) -> list[dict[str, Any]]:
    """What the collapses an evacuation started at its end did, once each has ended."""
    return [
        lazy.collapsed(lab, {**e, "huge_pages": e}, timeout) | {"container": e["container"]}
        for e in rec.get("huge_pages") or []
    ]


def dry_run(ev: Evacuation) -> dict[str, Any]:
    """The plan alone, as ``--dry-run`` prints it."""
    p = ev.plan()
    return {
        "node": ev.node,
        "dry_run": True,
        "rates": {k: r.basis for k, r in ev.rates.items()},
        "slowdown": {"factors": ev.slow, "basis": ev.slow_basis},
        "plan": p.to_dict(),
        "workloads": [asdict(o) | {"label": o.label} for o in ev.outcomes.values()],
    }
