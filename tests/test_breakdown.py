"""The blackout split into its steps (``engine.breakdown``) from made-up timelines: no lab needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from podmigrate.engine import breakdown
from podmigrate.engine.record import Record
from podmigrate.runtime.criu_conf import criu_log_end, criu_spans


def record() -> Record:
    """A stop-copy as the phases leave it: the probe saw the service go at 10.0 and come back at 11.0."""
    rec: Record = {
        "blackout": {"last_ok_before": 10.0, "first_ok_after": 11.0},
        "phases": [
            {"name": "checkpoint", "started": 9.9, "ended": 10.5},
            {"name": "restore", "started": 10.6, "ended": 10.9},
            {"name": "cutover", "started": 10.9, "ended": 10.95},
        ],
        "cutover": {"switches": [{"started": 10.91, "ended": 10.93}]},
    }
    breakdown.note(rec, "source", [["podman, runc: until CRIU dump", 9.92, 10.02], ["CRIU dump", 10.02, 10.4]])
    breakdown.note(rec, "target", [["CRIU restore", 10.7, 10.8], ["never ended", 10.8, None]])
    return rec


def test_every_instant_of_the_blackout_goes_to_the_most_specific_step_or_to_unaccounted() -> None:
    split = breakdown.steps(record())
    assert split is not None
    got = split["steps"]
    assert list(got) == [  # in the order they happen
        "source: podman, runc: until CRIU dump",
        "source: CRIU dump",
        "controller: checkpoint phase",
        "controller: restore phase",
        "target: CRIU restore",
        "controller: cutover phase",
        "LAN: route switch",
        "after the switch, until the copy answers",
    ]
    assert got["source: podman, runc: until CRIU dump"] == pytest.approx(0.02)  # only its part in the window
    assert got["source: CRIU dump"] == pytest.approx(0.38)
    assert got["controller: checkpoint phase"] == pytest.approx(0.1)  # what the agent's spans leave of it
    assert got["controller: restore phase"] == pytest.approx(0.2)
    assert got["LAN: route switch"] == pytest.approx(0.02)
    assert got["after the switch, until the copy answers"] == pytest.approx(0.07)
    assert got["controller: cutover phase"] == pytest.approx(0.01)
    # between the phases (10.5-10.6) nothing was measured: said so, not spread over the others
    assert split["unaccounted_s"] == pytest.approx(0.1)
    assert split["window_s"] == pytest.approx(1.0)
    assert sum(got.values()) + split["unaccounted_s"] == pytest.approx(split["window_s"], abs=0.002)


def test_no_window_no_split_and_a_controller_window_without_a_probe() -> None:
    assert breakdown.steps({}) is None
    rec: Record = {"freeze_started": 5.0, "first_answer_at": 6.0}
    assert breakdown.steps(rec) == {"window_s": 1.0, "steps": {}, "unaccounted_s": 1.0}


def test_criu_spans_come_from_the_open_of_its_configuration_and_the_last_stamp_of_its_log(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.000012) Version: 4.2\n(00.105000) Dumping\nno stamp here\n(01.250000) Dumping finished successfully\n"
    )
    assert criu_log_end(log) == 1.25
    spans: list[Any] = criu_spans("dump", 100.0, 100.2, log, 102.0)
    assert spans == [
        ["podman, runc: until CRIU dump", 100.0, 100.2],
        ["CRIU dump", 100.2, 101.45],
        ["podman: after CRIU dump", 101.45, 102.0],
    ]
    # without a log only the start is known; without the open, nothing
    assert criu_spans("dump", 100.0, 100.2, tmp_path / "none.log", 102.0) == [
        ["podman, runc: until CRIU dump", 100.0, 100.2]
    ]
    assert criu_spans("dump", 100.0, None, log, 102.0) == []


def test_a_criu_run_whose_log_podman_deleted_is_timed_by_criu_s_own_statistics(tmp_path: Path) -> None:
    spans: list[Any] = criu_spans("restore", 100.0, 100.1, None, 100.5, criu_s=0.25)
    assert spans == [
        ["podman, runc: until CRIU restore", 100.0, 100.1],
        ["CRIU restore", 100.1, 100.35],
        ["podman: after CRIU restore", 100.35, 100.5],
    ]


def _tab_row(heap: int, method: str, blackout: float) -> dict[str, Any]:
    steps = {"window_s": blackout, "steps": {"target: CRIU restore": blackout * 0.6}, "unaccounted_s": blackout * 0.4}
    return {"heap_mb": heap, "method": method, "n": 5, "blackout_s": blackout, "blackout_cutover_s": None,
            "drift_counter": 0, "criu_frozen_s": None, "state": "kept", "sha256_verified": "5/5", "phase_s": {},
            "archive_mib": 1.0, "pushed_mib": None, "blackout_steps": {"run": "r", **steps}}  # fmt: skip


def test_the_benchmark_states_each_target_ratio_and_the_report_draws_the_steps(tmp_path: Path) -> None:
    from podmigrate.bench import breakdown as bench_breakdown
    from podmigrate.bench import report

    table = [
        _tab_row(64, "lazy (post-copy)", 0.4), _tab_row(64, "cold restart", 0.5),
        _tab_row(1024, "lazy (post-copy)", 0.5), _tab_row(1024, "cold restart", 0.8),
        _tab_row(1024, "stop-copy/stream", 2.0), _tab_row(1024, "podman archive (export/copy/import)", 9.0),
        _tab_row(1024, "podman-one-node (export/import)", 7.0),
    ]  # fmt: skip
    rows = [{"warmup": False, "method": "decoupled/stream", "cutover_failed_probes": n} for n in (0, 2)]
    got = {r["ratio"]: (r["value"], r["holds"]) for r in bench_breakdown.ratios(table, rows)}
    assert got == {
        "lazy / cold at 64 MB": (0.8, True),
        "lazy / cold at 1024 MB": (0.625, False),
        "lazy 1024 MB / lazy 64 MB": (1.25, False),
        "podman export+import on one node / stop-copy/stream at 1024 MB": (3.5, False),
        "podman export, copy, import between nodes / stop-copy/stream at 1024 MB": (4.5, False),
        "failed probes at decoupled cutovers (2 runs)": (2, False),
    }
    (tmp_path / "bench.json").write_text(json.dumps({"table": table, "ratios": bench_breakdown.ratios(table, rows)}))
    report.build(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "- 1024 MB lazy (post-copy): 0.5 s = target: CRIU restore 0.3, unaccounted 0.2" in md
    assert "| lazy / cold at 1024 MB | 0.625 | <= 0.5 | NO |" in md
    assert (tmp_path / "blackout-steps.png").stat().st_size > 1000


def test_the_run_with_the_median_blackout_gives_the_steps() -> None:
    from podmigrate.bench.breakdown import median_run

    runs = [{"id": str(b), "blackout_s": b, "blackout_steps": {"window_s": b}} for b in (3.0, 1.0, 2.0, 4.0)]
    assert median_run(runs) == runs[2]  # 2.0: the lower middle of four
    assert median_run([{"id": "x", "blackout_s": 1.0, "blackout_steps": None}]) is None


@pytest.mark.lab
def test_a_real_migrations_record_says_where_its_blackout_went(lab: Any, workload: Any) -> None:
    from podmigrate.engine.controller import Plan, migrate

    st = workload(node="node-a", heap_mb=16)
    for mode, target, dump in (("stop-copy", "node-b", "source: CRIU dump"),
                               ("lazy", "node-a", "source: CRIU dump (all but the memory)")):  # fmt: skip
        rec = migrate(lab, Plan(workload=st["name"], target=target, mode=mode, transport="stream"))
        split = rec["blackout_steps"]
        assert split["window_s"] == rec["blackout_s"], split
        assert {dump, "target: CRIU restore", "LAN: route switch"} <= set(split["steps"]), split
        assert sum(split["steps"].values()) + split["unaccounted_s"] == pytest.approx(split["window_s"], abs=0.005)
        assert split["unaccounted_s"] < 0.25 * split["window_s"], split  # the steps are measured, not guessed


def test_the_benchmark_says_how_often_the_lazy_prefetch_was_in_time() -> None:
    from podmigrate.bench.breakdown import prefetches

    def row(outcome: str | None, warmup: bool = False) -> dict[str, Any]:
        pre = {"outcome": outcome, "bytes": 16 << 20} if outcome else {}
        return {"method": "lazy (post-copy)", "warmup": warmup, "prefetch": pre}

    rows = [row("used"), row("used"), row("missed"), row(None), row("used", warmup=True)]
    rows.append({"method": "cold restart", "warmup": False})
    assert prefetches(rows) == (
        "lazy prefetch: swapped in before the restore in 2 of 4 lazy runs (median 16.0 MB), "
        "too late in 1, not sent in 1"
    )
    assert prefetches([{"method": "cold restart", "warmup": False}]) is None


def test_the_benchmark_says_how_much_memory_went_back_into_huge_pages() -> None:
    from podmigrate.bench.breakdown import huge_pages

    def row(asked: int, done: int, s: float, warmup: bool = False) -> dict[str, Any]:
        return {"warmup": warmup, "huge_pages": {"bytes": asked << 20, "collapsed_bytes": done << 20, "seconds": s}}

    rows = [row(1022, 1022, 0.5), row(1022, 1000, 1.5), row(60, 60, 0.1), row(1022, 0, 9.0, warmup=True)]
    rows.append({"warmup": False, "huge_pages": {}})  # a cold restart: nothing to collapse
    assert huge_pages(rows) == (
        "huge pages: 2082 of 2104 MB collapsed back after 3 lazily filled restores "
        "(median 0.50 s each, after the blackout)"
    )
    assert huge_pages([{"warmup": False, "huge_pages": {}}]) is None
