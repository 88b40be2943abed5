"""Blackout from a probe log.

A probe *succeeds* when it got a 200 answer within ``timeout`` of being sent (a connect that only
got through on a SYN retransmit a second later counts as failed: the service was not there when
asked). Probes are ordered by send time; a *run* is a stretch of consecutive failed probes. The
blackout of a run lasts from the last moment the service was seen up before it (the answer of the
last success before the run, or the first failure's send time if that answer came later, as happens
with slow answers) to the answer of the first success after it. The migration's blackout is the
longest run that overlaps its window. A run still open at the end of the log counts to the last
answer and is flagged ``unfinished``. ``max_answer_gap_s`` (longest gap between consecutive
successful answers) is reported beside it.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any


def blackout(records: list[dict[str, Any]], start: float, end: float, timeout: float = 1.0) -> dict[str, Any]:
    recs = sorted(records, key=lambda r: r["sent"])
    ok = [bool(r["ok"]) and r["answered"] - r["sent"] <= timeout for r in recs]
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
    out["failed"] = sum(1 for r, good in zip(recs, ok, strict=True) if not good and start <= r["sent"] <= end)
    best: tuple[float, float | None, float | None, bool] = (0.0, None, None, False)
    i = 0
    while i < len(recs):
        if ok[i]:
            i += 1
            continue
        j = i
        while j < len(recs) and not ok[j]:
            j += 1
        if recs[j - 1]["sent"] >= start and recs[i]["sent"] <= end:
            up_before = min(recs[i - 1]["answered"], recs[i]["sent"]) if i > 0 else recs[i]["sent"]
            unfinished = j >= len(recs)
            up_after = recs[-1]["answered"] if unfinished else recs[j]["answered"]
            if up_after - up_before > best[0]:
                best = (
                    up_after - up_before,
                    up_before if i > 0 else None,
                    None if unfinished else up_after,
                    unfinished,
                )
        i = j
    out["blackout_s"] = round(best[0], 4)
    out["last_ok_before"], out["first_ok_after"], out["unfinished"] = best[1], best[2], best[3]
    answers = sorted(r["answered"] for r, good in zip(recs, ok, strict=True) if good and start - 1 <= r["sent"] <= end)
    out["max_answer_gap_s"] = round(max((b - a for a, b in itertools.pairwise(answers)), default=0.0), 4)
    return out


def counters_monotonic(records: list[dict[str, Any]], cut: float) -> dict[str, Any]:
    """Largest counter answered before ``cut`` and smallest after it: after must not be smaller."""
    before = [r["counter"] for r in records if r["ok"] and "counter" in r and r["answered"] < cut]
    after = [r["counter"] for r in records if r["ok"] and "counter" in r and r["sent"] > cut]
    hi, lo = (max(before) if before else None), (min(after) if after else None)
    return {"max_before": hi, "min_after": lo, "went_backwards": hi is not None and lo is not None and lo < hi}
