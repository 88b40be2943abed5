"""Blackout from a probe log.

Definition: within the migration's window, the longest run of failed probes (ordered by send time),
measured from the answer of the last successful probe before the run to the answer of the first
successful probe after it. A run still open at the end of the log counts to the log's end and is
flagged ``unfinished``. ``max_answer_gap_s`` (longest gap between consecutive successful answers in
the window) is reported beside it: it also catches a slow-but-successful stall.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any


def blackout(records: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    recs = sorted(records, key=lambda r: r["sent"])
    out: dict[str, Any] = {
        "probes": len(recs),
        "failed": 0,
        "blackout_s": 0.0,
        "last_ok_before": None,
        "first_ok_after": None,
        "unfinished": False,
        "max_answer_gap_s": 0.0,
    }
    if not recs:
        return out
    lag = [max(0.0, r["sent"] - r["scheduled"]) for r in recs if "scheduled" in r]
    if lag:
        out["schedule_error_p50_s"] = round(statistics.median(lag), 4)
        out["schedule_error_max_s"] = round(max(lag), 4)
    in_window = [r for r in recs if start <= r["sent"] <= end]
    out["failed"] = sum(1 for r in in_window if not r["ok"])
    best: tuple[float, float | None, float | None, bool] = (0.0, None, None, False)
    i = 0
    while i < len(recs):
        if recs[i]["ok"]:
            i += 1
            continue
        j = i
        while j < len(recs) and not recs[j]["ok"]:
            j += 1
        run_start, run_end = recs[i]["sent"], recs[j - 1]["sent"]
        if run_end >= start and run_start <= end:
            before = recs[i - 1]["answered"] if i > 0 else recs[i]["sent"]
            unfinished = j >= len(recs)
            after = recs[j]["answered"] if not unfinished else recs[-1]["answered"]
            if after - before > best[0]:
                best = (after - before, before if i > 0 else None, None if unfinished else after, unfinished)
        i = j
    out["blackout_s"] = round(best[0], 4)
    out["last_ok_before"], out["first_ok_after"], out["unfinished"] = best[1], best[2], best[3]
    ok_answers = sorted(r["answered"] for r in recs if r["ok"] and start - 1 <= r["sent"] <= end)
    gaps = [b - a for a, b in itertools.pairwise(ok_answers)]
    out["max_answer_gap_s"] = round(max(gaps, default=0.0), 4)
    return out


def counters_monotonic(records: list[dict[str, Any]], cut: float) -> dict[str, Any]:
    """Largest counter answered before ``cut`` and smallest after it: after must not be smaller."""
    before = [r["counter"] for r in records if r["ok"] and "counter" in r and r["answered"] < cut]
    after = [r["counter"] for r in records if r["ok"] and "counter" in r and r["sent"] > cut]
    hi, lo = (max(before) if before else None), (min(after) if after else None)
    return {"max_before": hi, "min_after": lo, "went_backwards": hi is not None and lo is not None and lo < hi}
