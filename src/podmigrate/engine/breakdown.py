"""Where a blackout goes: the steps inside it, from timestamps taken where they happen.

The window is the blackout the probe measured (its last answer before, its first answer after);
without a probe, the freeze to the copy's first answer. Inside it every instant is given to the most
specific span that covers it: the agents' own spans first (podman and runc until CRIU starts, CRIU
itself from its log's timestamps, podman after it, the stream, the route switch; the shortest when
they overlap), then the controller's phases (what a phase spent outside its agent's steps: the
request, the controller's own work). An instant no span covers is *unaccounted*, never spread
over the others. All the lab's clocks are one (its nodes are namespaces of one machine); across
machines the spans of different nodes would carry their clocks' offsets.

Neighbours: the phases add spans with ``note``; ``engine.summary`` calls ``steps`` once a migration
completed; ``bench.breakdown`` draws the median run's steps as stacked bars.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from podmigrate.engine.record import Record

UNACCOUNTED = "unaccounted"


def note(rec: Record, role: str, spans: Iterable[Any] | None) -> None:
    """Add an agent's spans ``[what, from, to]`` to the record's timeline, named by the node's role."""
    timeline = rec.setdefault("timeline", [])
    for what, t0, t1 in spans or ():
        if t0 is not None and t1 is not None and t1 >= t0:
            timeline.append([f"{role}: {what}", float(t0), float(t1)])


def window(rec: Record) -> tuple[float, float] | None:
    b = rec.get("blackout") or {}
    if b.get("last_ok_before") and b.get("first_ok_after"):
        return float(b["last_ok_before"]), float(b["first_ok_after"])
    if rec.get("freeze_started") and rec.get("first_answer_at"):
        return float(rec["freeze_started"]), float(rec["first_answer_at"])
    return None


def spans(rec: Record) -> list[tuple[str, float, float]]:
    """Every span the migration knows of: the agents', the route switch, the controller's phases."""
    out = [(str(w), float(a), float(b)) for w, a, b in rec.get("timeline") or []]
    for s in (rec.get("cutover") or {}).get("switches") or []:
        out.append(("LAN: route switch", float(s["started"]), float(s["ended"])))
    win = window(rec)
    switches = (rec.get("cutover") or {}).get("switches") or []
    if win and switches:
        out.append(("after the switch, until the copy answers", float(switches[-1]["ended"]), win[1]))
    for p in rec.get("phases") or []:
        if p.get("ended"):
            out.append((f"controller: {p['name']} phase", float(p["started"]), float(p["ended"])))
    return out


def steps(rec: Record) -> dict[str, Any] | None:
    """The blackout split into steps: ``{"window_s", "steps": {what: s}, "unaccounted_s"}`` (the
    steps in the order they first happen; they and ``unaccounted`` add up to the window)."""
    win = window(rec)
    if win is None or win[1] <= win[0]:
        return None
    start, end = win
    known = [(w, max(a, start), min(b, end)) for w, a, b in spans(rec) if b > start and a < end]
    cuts = sorted({start, end, *(a for _, a, _ in known), *(b for _, _, b in known)})
    totals: dict[str, float] = {}
    for a, b in itertools.pairwise(cuts):
        # a step measured where it happens before a controller's phase; then the shortest
        covering = [(w.startswith("controller: "), t1 - t0, w) for w, t0, t1 in known if t0 <= a and t1 >= b]
        what = min(covering)[2] if covering else UNACCOUNTED
        totals[what] = totals.get(what, 0.0) + (b - a)
    unaccounted = totals.pop(UNACCOUNTED, 0.0)
    return {
        "window_s": round(end - start, 4),
        "steps": {w: round(s, 4) for w, s in totals.items() if s >= 0.0005},
        "unaccounted_s": round(unaccounted, 4),
    }
