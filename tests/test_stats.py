"""Statistics of the benchmark report against scipy's own results for fixed samples."""

from __future__ import annotations

import json
from typing import Any

import pytest
from scipy import stats as sp

from podmigrate.bench import stats

A = [1.06, 1.01, 1.12, 0.98, 1.30, 1.05, 1.07, 0.99, 1.10, 1.02]
B = [1.02, 0.97, 1.00, 1.04, 0.96, 1.01, 1.03, 0.99, 1.05, 0.98, 1.00, 1.02]


def test_describe_gives_the_usual_figures():
    d = stats.describe(A)
    assert d["n"] == 10 and d["median"] == pytest.approx(1.055) and d["min"] == 0.98 and d["max"] == 1.30
    assert d["mean"] == pytest.approx(sum(A) / 10)
    assert d["stdev"] == pytest.approx(sp.tstd(A))
    low, high = d["median_ci95"]
    assert low <= d["median"] <= high
    assert stats.describe(A) == d  # seeded: the same CI every time


def test_compare_matches_scipy():
    c = stats.compare(A, B)
    mw = sp.mannwhitneyu(A, B, alternative="two-sided")
    welch = sp.ttest_ind(A, B, equal_var=False)
    assert c["mann_whitney_u"] == pytest.approx(mw.statistic) and c["mann_whitney_p"] == pytest.approx(mw.pvalue)
    assert c["welch_t"] == pytest.approx(welch.statistic) and c["welch_p"] == pytest.approx(welch.pvalue)
    assert c["rank_biserial"] == pytest.approx(2 * mw.statistic / (10 * 12) - 1)
    assert c["median_difference"] == pytest.approx(1.055 - 1.005)


def test_identical_groups_show_no_difference():
    c = stats.compare(B, B)
    assert c["mann_whitney_p"] == pytest.approx(1.0) and c["rank_biserial"] == pytest.approx(0.0)


def test_too_few_samples_are_said_so():
    assert stats.compare([1.0], B)["note"] == "too few samples for a test"
    assert stats.describe([]) == {"n": 0}


def test_spot_budget_adds_worst_case_detection():
    b = {x["deadline"]: x for x in stats.spot_budget(31.78)}
    assert b["AWS (120 s)"]["used_s"] == pytest.approx(36.78) and b["AWS (120 s)"]["fits"]
    assert b["AWS (120 s)"]["share"] == pytest.approx(0.3065, abs=1e-4)  # the study's 30.6 %
    assert not b["GKE spot, worst (15 s)"]["fits"]


def test_an_engine_sweep_alone_regenerates_the_studys_heap_table(tmp_path):
    from podmigrate.bench import report

    def row(heap: int, method: str, pushed_mib: float, checkpoint: float, push: float) -> dict[str, Any]:
        return {
            "heap_mb": heap, "method": method, "n": 2, "blackout_s": 1.0, "blackout_cutover_s": None,
            "drift_counter": 0, "criu_frozen_s": 0.25, "state": "kept", "sha256_verified": "2/2",
            "phase_s": {"checkpoint": checkpoint, "push": push, "pull": 0.5, "restore": 0.4},
            "archive_mib": heap + 5.0, "pushed_mib": pushed_mib,
        }  # fmt: skip

    table = [
        row(64, "stop-copy/registry", 69.0, 0.3, 0.4),
        row(64, "stop-copy/registry+gzip", 66.0, 0.3, 3.1),
        row(1024, "stop-copy/registry", 1029.0, 1.5, 6.0),
    ]
    (tmp_path / "bench.json").write_text(__import__("json").dumps({"table": table, "rows": []}))
    r = report.build(tmp_path)
    sweep = {s["heap_mb"]: s for s in r["study_tables"]["heap_sweep"]}
    assert sweep[64]["rpo_plain_s"] == 0.7 and sweep[64]["rpo_gzip_s"] == 3.4 and sweep[64]["layer_gzip_mib"] == 66.0
    assert sweep[1024]["worst_plain_s"] == 12.5 and sweep[1024]["spot_share"] == round(12.5 / 120, 3)
    assert sweep[1024]["rpo_gzip_s"] is None  # not measured: shown as such, not invented
    md = (tmp_path / "report.md").read_text()
    assert "The study's table 3" in md and "[36.78]" in md and "[24.31]" in md
    assert "The study's table 1" not in md  # no suite in this directory


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"group": "cold", "blackout_s": 1.0, "warmup": false, "phase_s": {}}\n{"group": "co',
            "line 2, is not a JSON",
        ),
        ("[1, 2]\n", "line 1, is not a suite row"),
    ],
)
def test_a_damaged_results_directory_is_a_clear_error_not_a_traceback(tmp_path, content, message):
    import subprocess
    import sys

    (tmp_path / "suite.jsonl").write_text(content)
    p = subprocess.run([sys.executable, "-c", "from podmigrate.cli import main; main()", "report", str(tmp_path)],
                       capture_output=True, text=True)  # fmt: skip
    said = " ".join(p.stderr.split())  # the console wraps long lines at its width
    assert p.returncode == 1 and message in said and "Traceback" not in p.stderr, p.stderr
    assert "delete that line" in said or "suite's results directory" in said


def test_a_kubernetes_run_alone_is_reported_without_the_suites_empty_sections(tmp_path):
    """bench k8s writes no machine.json and no suite: no 'Machine: None cores', no empty tables."""
    from podmigrate.bench import report

    (tmp_path / "k8s.json").write_text(json.dumps({"table": [], "targets": [], "pod_shape": "single"}))
    report.build(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## The Kubernetes path" in md and "the heap server alone, one container" in md
    assert "Machine:" not in md and "## Blackout per group" not in md and "## Checks" not in md
