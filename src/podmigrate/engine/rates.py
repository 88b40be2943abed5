"""What moving a workload costs here, learned from this lab's past migrations (``engine.schedule``'s
``Rate``s): per mode and transport, a straight line through (resident bytes, seconds until the
source was no longer needed) and through (resident bytes, blackout) of the completed migrations.

With migrations of sizes spanning 4x or more the line is fitted (least squares); otherwise the default's slope
through their median (see ``_line``); with none, the default: this lab's figures from
issue 14's benchmark (docs/measurements.md), marked as such in ``basis`` so that a plan shows what it rests on.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from podmigrate.engine.schedule import GB, Factor, Rate

# (fixed s, bytes per s, blackout fixed s, blackout bytes per s or None): 2-core VM, security on.
# Lazy's time is until its last page moved: ~0.3 GB/s with the verify's read of the heap beside the
# tail (issue 35: 2.5 s for 256 MB, 5.2 s for 1 GB; the daemon's tail alone 400-450 MB/s, 70 before);
# stop-copy/stream through the sealed page relay with the local lazy restore (issue 14, 2026-12-04
# night: 64 MB 1.4 s until the pages are in and verified, 0.64 s of blackout; 1 GB 5.1 s, 2.0 s)
DEFAULTS: dict[str, tuple[float, float, float, float | None]] = {
    "lazy/stream": (1.5, 0.3 * GB, 0.45, None),
    "stop-copy/stream": (1.0, 0.25 * GB, 0.5, 0.7 * GB),
    "stop-copy/archive": (2.0, 0.12 * GB, 0.6, 0.12 * GB),
    "stop-copy/registry": (2.5, 0.1 * GB, 0.8, 0.1 * GB),
    "cold/none": (1.5, 100 * GB, 0.5, None),  # the fallback: a fresh start, whatever the memory
}
PARK = "stop-copy/registry"  # a parked workload: checkpoint and push, no restore
COLD = "cold/none"


def way(rec: Mapping[str, Any]) -> str:
    return "cold/none" if rec.get("mode") == "cold" else f"{rec.get('mode')}/{rec.get('transport')}"


def _span(rec: Mapping[str, Any]) -> float | None:
    """Seconds from the first phase's start to the last one the source was needed for (not cleanup)."""
    phases = [p for p in rec.get("phases") or [] if p.get("ended") and p["name"] != "cleanup"]
    if not phases:
        return None
    return float(max(p["ended"] for p in phases) - min(p["started"] for p in phases))


def _line(points: list[tuple[float, float]], per: float | None) -> tuple[float, float | None]:
    """(fixed s, bytes per s) through the points. A slope only from 3 or more migrations whose
    sizes span 4x or more (two small ones close together extrapolate their noise to a gigabyte);
    otherwise the default's slope (``per``) through the points' median; a default that does not
    grow (lazy's blackout) stays flat, at the points' median."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if per is None:
        return statistics.median(ys), None
    if len(points) >= 3 and min(xs) > 0 and max(xs) / min(xs) >= 4:
        slope, intercept = statistics.linear_regression(xs, ys)
        if slope > 0:
            return max(0.0, intercept), 1 / slope
    x, y = statistics.median(xs), statistics.median(ys)
    return max(0.0, y - x / per), per  # the default's slope through this lab's point


def learn(
    records: Iterable[Mapping[str, Any]],
    defaults: Mapping[str, tuple[float, float, float, float | None]] = DEFAULTS,
    basis: str = "this lab's figures (issue 14)",
) -> dict[str, Rate]:
    """Rates from completed migrations (records of ``engine.record``), defaults where there are none."""
    seen: dict[str, list[tuple[float, float, float]]] = {}
    for rec in records:
        if rec.get("status") != "completed" or rec.get("scope") == "pod" or not rec.get("rss_bytes"):
            continue
        plan = rec.get("plan") or {}
        if plan.get("security", "on") != "on" or plan.get("old_paths"):
            continue  # a benchmark's variant (security off, an old path), not how this lab migrates
        span, blackout = _span(rec), rec.get("blackout_s")
        if span is None or blackout is None:
            continue
        seen.setdefault(way(rec), []).append((float(rec["rss_bytes"]), span, blackout))
    out: dict[str, Rate] = {}
    for w, (fixed, bps, bfixed, bbps) in defaults.items():
        mode, transport = w.split("/")
        pts = seen.get(w)
        if not pts:
            out[w] = Rate(mode, transport, fixed, bps, bfixed, bbps, f"default: {basis}")
            continue
        f, per = _line([(x, s) for x, s, _ in pts], bps)
        bf, bper = _line([(x, b) for x, _, b in pts], bbps)
        out[w] = Rate(mode, transport, f, per or bps, bf, bper, f"measured: {len(pts)} migrations")
    return out


SLOWDOWN = {1: 1.0, 2: 1.5}  # until past evacuations measured it: 2 cores, two CRIU dumps contend


def slowdowns(records: Iterable[Path], rates: Mapping[str, Rate]) -> tuple[dict[int, Factor], str]:
    """Per number of concurrent migrations and per mode, how much longer each took than ``rates``
    (what is known now, not what was at the time) predict, relative to one at a time (medians over
    past evacuations, 2 or more of each); the default for what none measured ("*")."""
    seen: dict[tuple[int, str], list[float]] = {}
    for p in records:
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        k = int(rec.get("parallel") or 1)
        for w in rec.get("workloads", []):
            r = rates.get(way(w))
            if w.get("status") == "moved" and w.get("took_s") and r is not None:
                seen.setdefault((k, str(w["mode"])), []).append(w["took_s"] / r.total(int(w["memory"])))
    out: dict[int, Factor] = {1: 1.0}
    notes: list[str] = []
    for k in sorted({k for k, _ in seen} | set(SLOWDOWN)):
        if k == 1:
            continue
        per: dict[str, float] = {"*": SLOWDOWN.get(k, 1.0 + 0.5 * (k - 1))}
        for (kk, mode), v in sorted(seen.items()):
            base = seen.get((1, mode), [])
            if kk == k and len(v) >= 2 and len(base) >= 2:
                per[mode] = round(max(1.0, statistics.median(v) / statistics.median(base)), 3)
                notes.append(f"{mode} {k} at once {per[mode]}x ({len(v)} vs {len(base)} alone)")
        out[k] = per
    return out, "measured: " + "; ".join(notes) if notes else f"default: {SLOWDOWN} for every mode"
