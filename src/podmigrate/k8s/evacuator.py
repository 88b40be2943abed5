"""One NodeEvacuation run: cordon the node, plan every pod's move against the deadline
(``engine.schedule``, as ``podmigrate evacuate`` does in the lab), one PodLiveMigration per pod.

What it knows: each pod's memory (its containers' memory requests, else limits, else an assumed
256 MiB, said so in the plan), each target's free memory (allocatable minus the requests of the pods
already there, as the scheduler counts it) and disk (its agent's checkpoint directory), and the
rates of past evacuations' migrations (``engine.rates.learn`` over them; defaults from this lab's
Kubernetes benchmark until there are some). Pods move by stop-copy through the registry (the only
state-keeping way the kubelet's API has; decoupled would lose what the source changes after its
checkpoint); one that cannot move in time is restarted cold if that ends in time (state lost, said
so), else reported lost. A migration that rolled back in a target-side phase takes that target out
and re-plans what has not started; any other failure is tried once on another target, then cold.

The status is written after every change, so a restarted operator picks up the migrations it had
created (their names are fixed by the evacuation and the pod). Deleting the NodeEvacuation stops new
migrations; running ones finish (each is its own resource, with its own rollback).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from podmigrate.engine import rates as rates_mod
from podmigrate.engine import schedule
from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s import evacuation as ev
from podmigrate.k8s.agents import Agents, Config
from podmigrate.k8s.crd import API_VERSION, SpecError
from podmigrate.k8s.crd import TERMINAL as PLM_TERMINAL
from podmigrate.k8s.drain import migration_of

LABEL = ev.ANNOTATION  # the node it empties and the migrations it made carry its name under one key
MIRROR = "kubernetes.io/config.mirror"
ASSUMED = 256 << 20
# (fixed s, bytes/s, blackout fixed s, blackout bytes/s): ``bench k8s`` on this machine, 64 MB-1 GB
# (docs/measurements.md)
K8S_DEFAULTS: dict[str, tuple[float, float, float, float | None]] = {
    "stop-copy/registry": (2.6, 65e6, 2.0, 65e6),
    "cold/none": (1.4, 100e9, 0.8, None),
}
TARGET_PHASES = ("Restoring", "CuttingOver")  # a rollback from these says the target failed
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

Event = Callable[[str, str, str], None]


def quantity(q: Any) -> int:
    """A Kubernetes memory quantity (``300Mi``, ``1G``, ``1048576``) in bytes."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]i|[kMGT])?", str(q).strip())
    if not m:
        raise SpecError(f"{q!r} is not a memory quantity (like 300Mi)")
    return int(float(m.group(1)) * _UNITS.get(m.group(2) or "", 1))


def pod_memory(pod: dict[str, Any]) -> tuple[int, str]:
    total, basis = 0, "requests"
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        q = (res.get("requests") or {}).get("memory") or (res.get("limits") or {}).get("memory")
        if q is None:
            return ASSUMED, f"assumed {ASSUMED >> 20} MiB (container {c.get('name')} has no memory request)"
        total += quantity(q)
    return total, basis


def _skip_reason(pod: dict[str, Any], namespaces: tuple[str, ...], own: str = "") -> str | None:
    meta = pod["metadata"]
    if own and meta.get("namespace") == own:
        return "podmigrate's own pod (its Deployment or DaemonSet places it)"
    if MIRROR in (meta.get("annotations") or {}):
        return "a static pod's mirror: its node runs it, not the API"
    if any(o.get("kind") == "DaemonSet" for o in meta.get("ownerReferences") or []):
        return "a DaemonSet pod: every node runs its own"
    if namespaces and meta.get("namespace") not in namespaces:
        return f"namespace {meta.get('namespace')} is not served by this operator"
    if meta.get("deletionTimestamp"):
        return "already being deleted"
    if not k.pod_ready(pod):
        return f"not running and ready (phase {(pod.get('status') or {}).get('phase')})"
    return None


@dataclass
class Evacuator:
    api: k.KubeAPI
    name: str
    config: Config
    event: Event = lambda _t, _r, _m: None
    poll_s: float = 0.5
    agents: Agents = field(init=False)

    def __post_init__(self) -> None:
        self.agents = Agents(self.api, self.config)

    # ------------------------------------------------------------------ status
    def _save(self, **status: Any) -> None:
        self.status.update(status)
        self.api.patch(ev.path(self.name, status=True), {"status": status})

    def _pods_saved(self) -> None:
        self._save(pods=self.status["pods"])

    # ------------------------------------------------------------------ survey
    def survey(self, node: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Pods to move (namespace, name, memory, basis) and those left alone with the reason."""
        moving, skipped = [], []
        for pod in self.api.list("/api/v1/pods", field_selector=f"spec.nodeName={node}"):
            if (pod.get("spec") or {}).get("nodeName") != node:
                continue  # field selectors are a server courtesy
            meta = pod["metadata"]
            why = _skip_reason(pod, self.config.namespaces, self.config.agent_namespace)
            if why:
                skipped.append({"namespace": meta["namespace"], "name": meta["name"], "why": why})
                continue
            memory, basis = pod_memory(pod)
            moving.append({"namespace": meta["namespace"], "name": meta["name"], "memory": memory, "basis": basis})
        return moving, skipped

    def targets(
        self, source: str, wanted: list[str], failed: set[str], moving: Sequence[str] = ()
    ) -> list[schedule.Target]:
        """Nodes the pods ``moving`` (``namespace/name``) may go to: ready, not cordoned, with an
        agent, and no NoSchedule/NoExecute taint that one of them does not tolerate."""
        pods = self.api.list("/api/v1/pods")
        tolerations = [((p.get("spec") or {}).get("tolerations") or []) for p in pods
                       if f"{p['metadata']['namespace']}/{p['metadata']['name']}" in set(moving)]  # fmt: skip
        out = []
        for node in self.api.list(k.nodes()):
            name = node["metadata"]["name"]
            if name == source or name in failed or (wanted and name not in wanted) or not k.node_ready(node):
                continue
            spec = node.get("spec") or {}
            hard = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
            if spec.get("unschedulable") or any(not tolerations or not all(tolerates(ts, t) for ts in tolerations)
                                                for t in hard):  # fmt: skip
                continue
            try:
                disk = self.agents.info(name).get("disk_free_bytes") or 0
            except PodmigrateError:
                continue  # no agent there: nothing can be restored on it
            alloc = quantity((node.get("status") or {}).get("allocatable", {}).get("memory", "0"))
            used = sum(pod_memory(p)[0] for p in pods if (p.get("spec") or {}).get("nodeName") == name)
            out.append(schedule.Target(name, max(0, alloc - used), int(disk)))
        return out

    def rates(self) -> dict[str, schedule.Rate]:
        """Learned from the migrations of past evacuations (their status keeps memory and times)."""
        recs = []
        for obj in self.api.list(ev.path()):
            for p in (obj.get("status") or {}).get("pods") or []:
                if p.get("phase") == "Completed" and p.get("tookSeconds") and p.get("mode"):
                    recs.append({"status": "completed", "mode": p["mode"], "transport": p.get("transport"),
                                 "rss_bytes": p["memory"], "blackout_s": p.get("blackoutSeconds") or 0.0,
                                 "phases": [{"name": "all", "started": 0.0, "ended": p["tookSeconds"]}]})  # fmt: skip
        return rates_mod.learn(recs, K8S_DEFAULTS, "this lab's bench k8s (docs/measurements.md)")

    def plan(self, pods: list[dict[str, Any]], targets: list[schedule.Target], left: float) -> schedule.EvacuationPlan:
        rates = self.rates()
        ws = [schedule.Workload(f"{p['namespace']}/{p['name']}", p["memory"], "k8s") for p in pods]
        par = self.spec.get("parallel")
        slow: dict[int, schedule.Factor] = {par: 1.0 + 0.5 * (par - 1)} if par else dict(rates_mod.SLOWDOWN)
        cold = rates.pop(rates_mod.COLD)
        return schedule.plan(ws, targets, rates, left, slow, park=None, cold=cold, reserve=0.15)

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        obj = self.api.get(ev.path(self.name))
        if obj is None:
            return {}
        self.status = dict(obj.get("status") or {})
        if self.status.get("phase") in ev.TERMINAL:
            return self.status
        try:
            self.spec, self.deadline = ev.validate_spec(obj.get("spec"), obj["metadata"].get("creationTimestamp"))
        except SpecError as e:
            self._save(phase="Failed", message=str(e))
            self.event("Warning", "InvalidSpec", str(e))
            return self.status
        node = self.spec["nodeName"]
        if self.api.get(k.nodes(node)) is None:
            self._save(phase="Failed", message=f"spec.nodeName: there is no node {node!r}")
            return self.status
        self.started = ev.epoch(self.status["startedAt"]) if self.status.get("startedAt") else time.time()
        self.api.patch(
            k.nodes(node), {"spec": {"unschedulable": True}, "metadata": {"annotations": {LABEL: self.name}}}
        )
        if "pods" not in self.status:
            self._first_plan(node)
        self._drive(node)
        return self.status

    def _first_plan(self, node: str) -> None:
        pods, skipped = self.survey(node)
        left = self.deadline - time.time()
        moving = [f"{q['namespace']}/{q['name']}" for q in pods]
        p = self.plan(pods, self.targets(node, self.spec.get("targetNodes") or [], set(), moving), left)
        by = {f"{q['namespace']}/{q['name']}": q for q in pods}
        rows = [self._row(by[s.workload], s) for s in p.steps]
        self._save(phase="Evacuating", startedAt=ev.stamp(self.started), deadline=ev.stamp(self.deadline),
                   plan={**p.to_dict(), "memory": {q["name"]: q["basis"] for q in pods}},
                   pods=rows, skipped=skipped, replans=[], parallel=p.parallel)  # fmt: skip
        self.event("Normal", "Planned", f"{len(rows)} pods off {node} in {left:.0f} s: "
                   f"{p.count('migrate')} migrate, {p.count('restart')} restart, {p.count('lost')} lost; "
                   f"{p.parallel} at once, predicted empty at T+{p.end_s:.1f} s")  # fmt: skip

    @staticmethod
    def _row(pod: dict[str, Any], s: schedule.Step) -> dict[str, Any]:
        lost = s.action == "lost"
        return {"namespace": pod["namespace"], "name": pod["name"], "memory": pod["memory"],
                "action": s.action, "target": s.target, "mode": s.mode, "transport": s.transport,
                "predictedEndSeconds": round(s.end_s, 2), "phase": "Lost" if lost else "Waiting",
                "why": s.why, "stateKept": False}  # fmt: skip

    def _migration_name(self, row: dict[str, Any]) -> str:
        tag = hashlib.sha256(f"{self.name}/{row['namespace']}/{row['name']}/{row.get('attempt', 0)}".encode())
        return f"{row['name'][:200]}-ev{tag.hexdigest()[:6]}"

    def _start(self, row: dict[str, Any]) -> None:
        # a migration of the pod already running (kubectl drain's, through the eviction webhook, or a
        # user's) is waited for, not raced: a second one would be refused and re-planned, again and again
        other = migration_of(self.api, row["namespace"], row["name"])
        if other is not None and (other.get("status") or {}).get("phase") not in PLM_TERMINAL:
            mode = other["spec"].get("mode", "decoupled")
            row.update(migration=other["metadata"]["name"], phase="Running", mode=mode,
                       startedAfterSeconds=round(time.time() - self.started, 2))  # fmt: skip
            return
        row["migration"] = self._migration_name(row)
        mode = "cold" if row["action"] == "restart" else "stop-copy"
        body = {"apiVersion": API_VERSION, "kind": "PodLiveMigration",
                "metadata": {"name": row["migration"], "namespace": row["namespace"], "labels": {LABEL: self.name}},
                "spec": {"podName": row["name"], "targetNode": row["target"], "mode": mode}}  # fmt: skip
        if self.api.get(k.migrations(row["namespace"], row["migration"])) is None:
            self.api.create(k.migrations(row["namespace"]), body)
        row.update(phase="Running", startedAfterSeconds=round(time.time() - self.started, 2), mode=mode)

    def _drive(self, node: str) -> None:
        failed: set[str] = set()
        while True:
            rows = self.status["pods"]
            changed = any([self._check(r, failed, node) for r in rows if r["phase"] == "Running"])
            obj = self.api.get(ev.path(self.name))
            stopping = obj is None or bool(obj["metadata"].get("deletionTimestamp"))
            running = [r for r in rows if r["phase"] == "Running"]
            for r in [r for r in rows if r["phase"] == "Waiting"]:
                if stopping or time.time() >= self.deadline:
                    r.update(phase="Lost", why="the deadline passed before it could start"
                             if not stopping else "the NodeEvacuation was deleted before it started")  # fmt: skip
                    changed = True
                elif len(running) < int(self.status.get("parallel") or 1):
                    self._start(r)
                    running.append(r)
                    changed = True
            if changed:
                self._pods_saved()
            if not any(r["phase"] in ("Running", "Waiting") for r in rows):
                break
            time.sleep(self.poll_s)
        self._finish(node)

    def _check(self, row: dict[str, Any], failed: set[str], node: str) -> bool:
        plm = self.api.get(k.migrations(row["namespace"], row["migration"]))
        st = (plm or {}).get("status") or {}
        if plm is not None and st.get("phase") not in PLM_TERMINAL:
            return False
        took = round(time.time() - self.started - row.get("startedAfterSeconds", 0.0), 2)
        if st.get("phase") == "Completed":
            row.update(phase="Completed", stateKept=row["mode"] != "cold", blackoutSeconds=st.get("blackoutSeconds"),
                       tookSeconds=took, finishedAfterSeconds=round(time.time() - self.started, 2),
                       restoredPod=(st.get("restoredPod") or {}).get("name"))  # fmt: skip
            return True
        why = st.get("message") or "the PodLiveMigration is gone"
        target_failed = (st.get("record") or {}).get("phase") in ("restore", "cutover")
        if target_failed:
            failed.add(row["target"])
        self.event("Warning", "MigrationFailed", f"{row['name']} to {row['target']}: {why}")
        self._replan(row, failed, node, why)
        return True

    def _replan(self, row: dict[str, Any], failed: set[str], node: str, why: str) -> None:
        """Another target, then a cold restart, for ``row`` and the not yet started on a failed target."""
        again = [row] + [r for r in self.status["pods"] if r["phase"] == "Waiting" and r["target"] in failed]
        tried = {r["name"]: set(r.get("tried", [])) | {r["target"]} for r in again}
        moving = [f"{r['namespace']}/{r['name']}" for r in again]
        targets = self.targets(node, self.spec.get("targetNodes") or [], failed, moving)
        left = self.deadline - time.time()
        for r in again:
            others = [t for t in targets if t.name not in tried[r["name"]]] or targets
            p = self.plan([r], others, left) if others else None
            step = p.steps[0] if p else schedule.Step(r["name"], r["memory"], "lost", why="no target left")
            if r is row and row["action"] == "restart" and step.action == "migrate":
                step = schedule.Step(r["name"], r["memory"], "lost", why=f"the cold restart failed: {why}")
            r.update(action=step.action, target=step.target, mode=step.mode, transport=step.transport,
                     tried=sorted(tried[r["name"]]), attempt=int(r.get("attempt", 0)) + 1,
                     phase="Lost" if step.action == "lost" else "Waiting",
                     why=step.why if step.action != "migrate" else f"again after: {why}")  # fmt: skip
        self.status.setdefault("replans", []).append({"afterSeconds": round(time.time() - self.started, 2),
                                                      "why": why, "failedTargets": sorted(failed),
                                                      "pods": [r["name"] for r in again]})  # fmt: skip
        self._save(replans=self.status["replans"])

    def _finish(self, node: str) -> None:
        rows = self.status["pods"]
        end = max((r.get("finishedAfterSeconds", 0.0) for r in rows), default=0.0)
        kept = sum(bool(r.get("stateKept")) for r in rows)
        lost = [r["name"] for r in rows if r["phase"] == "Lost"]
        in_time = self.started + end <= self.deadline
        ok = not lost and kept == len(rows) and in_time
        late = "" if in_time else " (after the deadline)"
        msg = f"{kept} of {len(rows)} pods moved with their state, empty at T+{end:.1f} s{late}"
        msg += f"; lost: {', '.join(lost)}" if lost else ""
        self._save(phase="Completed" if ok else "Incomplete", message=msg, emptyAfterSeconds=end,
                   completedAt=ev.stamp(time.time()))  # fmt: skip
        self.event("Normal" if ok else "Warning", "Evacuated" if ok else "Incomplete", f"{node}: {msg}")

    def close(self) -> None:
        self.agents.close()


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    """Whether a pod with ``tolerations`` may be placed on a node with ``taint`` (Kubernetes' rule)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if taint.get("effect") == "NoExecute" and t.get("tolerationSeconds") is not None:
            continue  # evicted again once the seconds pass: not a place to move to
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False
