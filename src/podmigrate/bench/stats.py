"""Statistics for benchmark results (scipy): descriptions, tests between groups, the Spot budget.

``describe`` gives n, median, mean, stdev, p5/p95, min/max and a bootstrap 95% CI of the median;
``compare`` gives the two-sided Mann-Whitney U and Welch's t-test between two groups with effect sizes
(rank-biserial correlation, Cohen's d, difference of medians); ``spot_budget`` sets an evacuation
time against the preemption notices of the clouds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

SPOT_DEADLINES_S = {"AWS (120 s)": 120.0, "GCP/Azure (30 s)": 30.0, "GKE spot, worst (15 s)": 15.0}
DETECTION_WORST_S = 5.0  # the study's worst-case detection of a Spot interruption notice


def describe(values: Sequence[float], seed: int = 0, resamples: int = 10_000) -> dict[str, Any]:
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return {"n": 0}
    out: dict[str, Any] = {
        "n": int(x.size),
        "median": float(np.median(x)),
        "mean": float(x.mean()),
        "stdev": float(x.std(ddof=1)) if x.size > 1 else 0.0,
        "p5": float(np.percentile(x, 5)),
        "p95": float(np.percentile(x, 95)),
        "min": float(x.min()),
        "max": float(x.max()),
    }
    if x.size > 1:
        ci = stats.bootstrap(
            (x,),
            np.median,
            confidence_level=0.95,
            n_resamples=resamples,
            method="percentile",
            random_state=np.random.default_rng(seed),
        )
        out["median_ci95"] = [float(ci.confidence_interval.low), float(ci.confidence_interval.high)]
    return out


def compare(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Group ``a`` against group ``b`` (e.g. a migration mode against cold restart)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.size < 2 or y.size < 2:
        return {"n_a": int(x.size), "n_b": int(y.size), "note": "too few samples for a test"}
    mw = stats.mannwhitneyu(x, y, alternative="two-sided")
    welch = stats.ttest_ind(x, y, equal_var=False)
    pooled = math.sqrt(((x.size - 1) * x.var(ddof=1) + (y.size - 1) * y.var(ddof=1)) / (x.size + y.size - 2))
    return {
        "n_a": int(x.size),
        "n_b": int(y.size),
        "median_difference": float(np.median(x) - np.median(y)),
        "mann_whitney_u": float(mw.statistic),
        "mann_whitney_p": float(mw.pvalue),
        # 2U/(n1 n2) - 1: +1 when every a is larger than every b, -1 when every a is smaller
        "rank_biserial": float(2 * mw.statistic / (x.size * y.size) - 1),
        "welch_t": float(welch.statistic),
        "welch_p": float(welch.pvalue),
        "cohens_d": float((x.mean() - y.mean()) / pooled) if pooled > 0 else 0.0,
    }


def spot_budget(source_side_s: float, detection_s: float = DETECTION_WORST_S) -> list[dict[str, Any]]:
    """Detection (worst case) plus the source-side work, against each cloud's notice."""
    total = detection_s + source_side_s
    return [
        {
            "deadline": name,
            "seconds": limit,
            "used_s": round(total, 3),
            "share": round(total / limit, 4),
            "fits": total <= limit,
        }
        for name, limit in SPOT_DEADLINES_S.items()
    ]
