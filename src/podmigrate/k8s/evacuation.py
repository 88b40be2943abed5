"""The NodeEvacuation custom resource, and the node changes that create one.

A NodeEvacuation (cluster-scoped, like the node it empties) asks the operator to move every pod off
``spec.nodeName`` before its deadline (``k8s.evacuator`` plans and runs it, one PodLiveMigration per
pod). The operator also makes one itself when a node shows one of the signs below, each with the
time a real node has left (``PODMIGRATE_EVACUATE_ON`` narrows or extends the table, ``key=seconds``,
comma separated; empty turns it off):

- ``aws-node-termination-handler/spot-itn`` (aws-node-termination-handler's taint on a Spot
  interruption notice): 120 s from the taint's ``timeAdded``;
- ``aws-node-termination-handler/asg-lifecycle-termination``: 300 s (the lifecycle hook's
  default heartbeat window is longer; the handler's drain budget is what we meet);
- ``cloud.google.com/impending-node-termination`` (GKE Spot/preemptible): 30 s;
- ``node.kubernetes.io/unschedulable`` or ``spec.unschedulable`` (``kubectl cordon``, the first
  half of ``kubectl drain``): 600 s, the drain's own deadline being the user's.

A node handled carries the annotation ``podmigrate.io/evacuation`` (the NodeEvacuation's name)
until it is schedulable and unmarked again, so one sign makes one evacuation, not one per update.
"""

from __future__ import annotations

import calendar
import os
import re
import time
from typing import Any

from podmigrate.k8s.crd import _DNS_SUBDOMAIN, GROUP, VERSION, SpecError, check_schema, definition

KIND = "NodeEvacuation"
PLURAL = "nodeevacuations"
SINGULAR = "nodeevacuation"
SHORT_NAMES = ["nev"]
PHASES = ("Pending", "Evacuating", "Completed", "Incomplete", "Failed")
TERMINAL = ("Completed", "Incomplete", "Failed")
ANNOTATION = "podmigrate.io/evacuation"
TRIGGERS_ENV = "PODMIGRATE_EVACUATE_ON"
DRAIN = "node.kubernetes.io/unschedulable"
TRIGGERS: dict[str, float] = {
    "aws-node-termination-handler/spot-itn": 120.0,
    "aws-node-termination-handler/asg-lifecycle-termination": 300.0,
    "cloud.google.com/impending-node-termination": 30.0,
    DRAIN: 600.0,
}

SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["nodeName"],
    "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "spec is immutable; create a new one"}],
    "properties": {
        "nodeName": {"type": "string", "maxLength": 253, "pattern": _DNS_SUBDOMAIN,
                     "description": "The node to empty; it is cordoned first."},
        "deadline": {"type": "string", "format": "date-time",
                     "description": "When the node goes away (RFC 3339). Absent: deadlineSeconds after creation."},
        "deadlineSeconds": {"type": "integer", "minimum": 1, "maximum": 86400, "default": 120,
                            "description": "Seconds from creation the node has left, when deadline is absent."},
        "targetNodes": {"type": "array", "items": {"type": "string", "pattern": _DNS_SUBDOMAIN},
                        "description": "Nodes the pods may go to. Absent: every other Ready, schedulable node."},
        "parallel": {"type": "integer", "minimum": 1, "maximum": 8,
                     "description": "Migrations at once. Absent: the plan picks (1 or 2)."},
        "reason": {"type": "string", "maxLength": 253,
                   "description": "What asked for it: a taint key, or manual."},
    },
}  # fmt: skip

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": list(PHASES)},
        "message": {"type": "string"},
        "deadline": {"type": "string", "format": "date-time"},
        "startedAt": {"type": "string", "format": "date-time"},
        "completedAt": {"type": "string", "format": "date-time"},
        "emptyAfterSeconds": {"type": "number"},
        "parallel": {"type": "integer", "description": "Migrations at once, as planned."},
        "pods": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                 "description": "Per pod: namespace, name, memory, action, target, migration, phase, "
                 "blackoutSeconds, finishedAfterSeconds, stateKept, why."},
        "skipped": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "plan": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "replans": {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    },
}  # fmt: skip

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"},
    {"name": "Reason", "type": "string", "jsonPath": ".spec.reason"},
    {"name": "Deadline", "type": "string", "jsonPath": ".status.deadline"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Empty after", "type": "number", "jsonPath": ".status.emptyAfterSeconds", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict[str, Any]:
    schema = {"type": "object", "required": ["spec"],
              "description": "Move every pod off a node before its deadline, with their memory.",
              "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                             "metadata": {"type": "object"}, "spec": SPEC_SCHEMA, "status": STATUS_SCHEMA}}  # fmt: skip
    names = {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES}
    return definition(names, "Cluster", PRINTER_COLUMNS, schema)


def path(name: str = "", status: bool = False) -> str:
    base = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
    return f"{base}/{name}" + ("/status" if status else "") if name else base


def epoch(stamp: str) -> float:
    """RFC 3339 (``...Z`` or with an offset, fractions allowed) as seconds since the epoch."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp.strip())
    if not m:
        raise SpecError(f"{stamp!r} is not an RFC 3339 time (like 2026-12-04T10:00:00Z)")
    base = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + float(m.group(2) or 0)
    if m.group(3) != "Z":
        sign = 1 if m.group(3)[0] == "+" else -1
        base -= sign * (int(m.group(3)[1:3]) * 3600 + int(m.group(3)[4:6]) * 60)
    return base


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def validate_spec(spec: Any, created: str | None) -> tuple[dict[str, Any], float]:
    """The spec and its deadline (epoch seconds), or ``SpecError`` naming the field at fault."""
    if not isinstance(spec, dict):
        raise SpecError("spec must be an object with at least nodeName")
    check_schema(SPEC_SCHEMA, spec)
    out = {"deadlineSeconds": 120, **spec}
    if out.get("deadline"):
        try:
            deadline = epoch(out["deadline"])
        except SpecError as e:
            raise SpecError(f"spec.deadline: {e}") from None
    else:
        deadline = (epoch(created) if created else time.time()) + out["deadlineSeconds"]
    if out["nodeName"] in (out.get("targetNodes") or []):
        raise SpecError(f"spec.targetNodes: {out['nodeName']!r} is the node being emptied")
    return out, deadline


def triggers(env: str | None = None) -> dict[str, float]:
    """The signs acted on: ``PODMIGRATE_EVACUATE_ON`` (``key=seconds,...``; empty: none) or the defaults."""
    raw = os.environ.get(TRIGGERS_ENV) if env is None else env
    if raw is None:
        return dict(TRIGGERS)
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, seconds = item.partition("=")
        try:
            out[key] = float(seconds) if sep else TRIGGERS[key]
        except (KeyError, ValueError):
            raise SpecError(
                f"{TRIGGERS_ENV}: {item!r} is not key=seconds",
                hint=f"for example {DRAIN}=600,aws-node-termination-handler/spot-itn=120",
            ) from None
    return out


def trigger_of(node: dict[str, Any], table: dict[str, float], now: float) -> tuple[str, float] | None:
    """The sign on ``node`` with the earliest deadline (key, epoch seconds), if any."""
    spec = node.get("spec") or {}
    found: list[tuple[float, str]] = []
    for taint in spec.get("taints") or []:
        key = taint.get("key")
        if key in table:
            since = epoch(taint["timeAdded"]) if taint.get("timeAdded") else now
            found.append((since + table[key], key))
    if spec.get("unschedulable") and DRAIN in table and not any(k == DRAIN for _, k in found):
        found.append((now + table[DRAIN], DRAIN))
    if not found:
        return None
    deadline, key = min(found)
    return key, deadline


def name_for(node: str, key: str, now: float) -> str:
    """A NodeEvacuation name: the node, what asked, when (a DNS subdomain, at most 253)."""
    what = key.rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9.-]", "-", f"{node[:200]}-{what[:30]}-{int(now)}")
