"""The evacuation planner (``engine.schedule``): fits, does not fit, a target that fails (no lab)."""

from __future__ import annotations

import pytest

from podmigrate.engine.schedule import GB, Rate, Target, Workload, plan

MB = 1 << 20
# this lab's figures, roughly: lazy's blackout flat, stop-copy's growing with the heap
RATES = {
    "lazy/stream": Rate("lazy", "stream", 1.0, 1.0 * GB, 0.45, None, "test"),
    "stop-copy/stream": Rate("stop-copy", "stream", 1.5, 0.3 * GB, 0.5, 0.3 * GB, "test"),
    "stop-copy/archive": Rate("stop-copy", "archive", 2.0, 0.1 * GB, 0.8, 0.1 * GB, "test"),
}
PARK = Rate("stop-copy", "registry-park", 1.0, 0.2 * GB, 0.0, None, "test")
BIG = Target("node-b", 20 * GB, 50 * GB)


def workloads() -> list[Workload]:
    return [Workload(f"w{i}", 256 * MB) for i in range(4)] + [Workload("big", GB), Workload("pod", 64 * MB, "pod")]


def test_a_node_that_fits_moves_everything_the_least_blackout_way_longest_first() -> None:
    p = plan(workloads(), [BIG], RATES, 120, park=PARK)
    assert p.fits and p.parallel == 1 and all(s.action == "migrate" and s.target == "node-b" for s in p.steps)
    assert [s.workload for s in p.steps][:2] == ["pod", "big"]  # the longest jobs first (archive: 2.6 s)
    ways = {s.workload: f"{s.mode}/{s.transport}" for s in p.steps}
    assert ways["big"] == "lazy/stream" and ways["pod"] == "stop-copy/archive"  # pods: archive only
    assert p.end_s == pytest.approx(sum(s.end_s - s.start_s for s in p.steps))  # one lane, back to back
    assert p.steps[1].blackout_s == pytest.approx(0.45)  # lazy: flat


def test_two_at_a_time_is_taken_when_one_at_a_time_misses_the_deadline_whatever_its_blackout() -> None:
    slow = {1: 1.0, 2: 1.6}
    alone = plan(workloads(), [BIG], RATES, 120, slowdown={1: 1.0}, park=PARK)
    tight = alone.end_s * 0.9  # one lane cannot make it, two can (1.6x slower each)
    p = plan(workloads(), [BIG], RATES, tight, slowdown=slow, park=PARK)
    assert set(p.considered) == {1, 2} and p.parallel == 2 and p.fits
    assert p.considered[2] < p.considered[1] and p.end_s <= tight
    # with time to spare, one at a time: 1.6x the blackout is more than an earlier end is worth
    roomy = plan(workloads(), [BIG], RATES, 120, slowdown=slow, park=PARK)
    assert roomy.parallel == 1 and roomy.total_blackout_s < p.total_blackout_s
    p = plan(workloads(), [BIG], RATES, tight, slowdown={1: 1.0, 2: 2.5}, park=PARK)
    assert p.parallel == 1 and not p.fits  # too much contention: two lanes would lose more


def test_with_time_to_spare_two_lanes_are_taken_when_they_cost_at_most_half_again_the_blackout() -> None:
    """A deadline may come sooner than announced: an earlier empty node is worth some blackout."""
    alone = plan(workloads(), [BIG], RATES, 120, slowdown={1: 1.0}, park=PARK)
    for factor, lanes in ((1.3, 2), (1.5, 2), (1.51, 1)):
        p = plan(workloads(), [BIG], RATES, 120, slowdown={1: 1.0, 2: factor}, park=PARK)
        assert p.parallel == lanes and p.fits, factor
        assert set(p.considered) == {1, 2} and p.considered[2] < p.considered[1]
        if lanes == 2:
            assert p.end_s < alone.end_s and p.total_blackout_s <= 1.5 * alone.total_blackout_s + 0.01
    # a third lane that ends no sooner is not taken for nothing
    p = plan(workloads(), [BIG], RATES, 120, slowdown={1: 1.0, 2: 1.2, 3: 3.0}, park=PARK)
    assert p.parallel == 2


def test_in_lanes_a_step_frozen_most_of_its_length_goes_after_the_others_when_that_loses_nothing() -> None:
    rates = {**RATES, "stop-copy/archive": Rate("stop-copy", "archive", 1.0, 0.1 * GB, 0.8, 0.1 * GB, "test")}
    p = plan(workloads(), [BIG], rates, 120, slowdown={2: 1.3}, park=PARK)
    starts = {s.workload: s.start_s for s in p.steps}
    assert p.parallel == 2 and p.fits
    assert starts["pod"] == max(starts.values()) > 0  # not beside the 1 GB move, which starts at once
    one = plan(workloads(), [BIG], RATES, 120, slowdown={1: 1.0}, park=PARK)
    assert one.steps[0].workload == "pod"  # one lane: longest first, as before
    # where the pod last would not end in time, longest first stays (nothing is given up for it)
    p = plan(workloads(), [BIG], rates, p.end_s * 0.95, slowdown={2: 1.3}, park=PARK)
    assert p.fits and {s.workload: s.start_s for s in p.steps}["pod"] == 0.0
    # and where it would end more than 10 % later (RATES' longer archive), too
    p = plan(workloads(), [BIG], RATES, 120, slowdown={2: 1.3}, park=PARK)
    assert {s.workload: s.start_s for s in p.steps}["pod"] == 0.0


def test_a_reserve_keeps_every_step_that_far_before_the_deadline() -> None:
    p = plan(workloads(), [BIG], RATES, 20, park=PARK, reserve=0.25)
    assert p.fits and p.end_s <= 15


def test_what_no_target_can_hold_is_parked_and_the_plan_says_why() -> None:
    small = Target("node-b", 1 * GB, 50 * GB)  # 768 MiB left after the margin
    p = plan(workloads(), [small], RATES, 120, park=PARK)
    by = {s.workload: s for s in p.steps}
    assert by["big"].action == "park" and "no target has 1.10 GiB of memory" in by["big"].why
    assert "restorable later" in by["big"].why
    moved = [s for s in p.steps if s.action == "migrate"]
    assert sum(s.memory for s in moved) * 1.1 <= small.memory_free - (256 << 20)  # never over the target
    assert not p.fits


def test_a_deadline_too_short_for_anything_reports_each_workload_lost_with_the_reason() -> None:
    p = plan(workloads(), [BIG], RATES, 1.0, park=PARK)
    assert {s.action for s in p.steps} == {"lost"}
    assert all("no way of moving it ends before the deadline" in s.why for s in p.steps)
    assert all("no fallback ends in time either" in s.why for s in p.steps)
    assert p.end_s == 0.0 and not p.fits


def test_a_deadline_that_only_the_first_workloads_meet_moves_those_and_parks_or_loses_the_rest() -> None:
    p = plan(workloads(), [BIG], RATES, 4.0, park=PARK)
    actions = [s.action for s in p.steps]
    assert actions[0] == "migrate" and "lost" in actions
    assert all(s.end_s <= 4.0 for s in p.steps if s.action != "lost")


def test_a_cold_restart_is_the_last_fallback_and_says_the_state_is_lost() -> None:
    cold = Rate("cold", "none", 0.5, 100 * GB, 0.3, None, "test")
    p = plan([Workload("big", GB)], [BIG], RATES, 1.2, cold=cold)
    (s,) = p.steps
    assert s.action == "restart" and s.target == "node-b" and "its state lost" in s.why and not p.fits
    p = plan(
        [Workload("big", GB)],
        [BIG],
        RATES,
        1.2,
        cold=cold,
        park=Rate("stop-copy", "registry", 0.1, 100 * GB, 0, None, "t"),
    )
    assert p.steps[0].action == "park"  # a parked checkpoint keeps the state: better than a restart


def test_a_failed_target_is_left_out_when_the_rest_is_planned_again() -> None:
    two = [Target("node-b", 20 * GB, 50 * GB), Target("node-c", 20 * GB, 50 * GB)]
    first = plan(workloads(), two, RATES, 120, park=PARK)
    assert {s.target for s in first.steps} == {"node-b", "node-c"}  # spread over both
    done = {first.steps[0].workload}
    rest = [w for w in workloads() if w.name not in done]
    again = plan(rest, [t for t in two if t.name != "node-b"], RATES, 120 - first.steps[0].end_s, park=PARK)
    assert {s.target for s in again.steps} == {"node-c"} and again.fits
    assert {s.workload for s in again.steps} == {w.name for w in rest}


def _rec(mode: str, rss: int, span: float, blackout: float, status: str = "completed") -> dict[str, object]:
    phases = [{"name": "validate", "started": 100.0, "ended": 100.5},
              {"name": "verify", "started": 100.5, "ended": 100.0 + span},
              {"name": "cleanup", "started": 100.0 + span, "ended": 200.0 + span}]  # fmt: skip
    return {"status": status, "mode": mode, "transport": "stream", "rss_bytes": rss, "phases": phases,
            "blackout_s": blackout}  # fmt: skip


def test_rates_are_fitted_from_past_migrations_and_say_when_they_are_only_defaults() -> None:
    from podmigrate.engine.rates import DEFAULTS, learn

    records = [
        _rec("stop-copy", 64 * MB, 1.0, 0.7), _rec("stop-copy", GB, 4.0, 3.6),
        _rec("stop-copy", GB, 4.0, 3.6), _rec("lazy", 64 * MB, 1.2, 0.42),
        _rec("lazy", 256 * MB, 1.35, 0.40), _rec("lazy", GB, 2.0, 0.42),
        _rec("lazy", 2 * GB, 99.0, 9.0, status="rolled_back"),  # only completed ones count
    ]  # fmt: skip
    rates = learn(records)
    sc = rates["stop-copy/stream"]
    assert sc.basis == "measured: 3 migrations"
    assert sc.total(GB) == pytest.approx(4.0, rel=0.01) and sc.total(64 * MB) == pytest.approx(1.0, rel=0.01)
    assert sc.blackout(GB) == pytest.approx(3.6, rel=0.01)  # cleanup is not counted: the source was free
    lazy = rates["lazy/stream"]
    assert lazy.blackout_bytes_per_s is None and lazy.blackout(4 * GB) == pytest.approx(0.42)  # flat
    assert lazy.total(GB) == pytest.approx(2.0, rel=0.03)
    # two migrations of nearly one size: no slope from them (their noise would be a gigabyte's error)
    close = learn([_rec("stop-copy", 100 * MB, 1.0, 0.62), _rec("stop-copy", 128 * MB, 1.3, 0.61)])
    assert close["stop-copy/stream"].basis == "measured: 2 migrations"
    per = DEFAULTS["stop-copy/stream"][3] or 1.0  # the default's rate through their median, not their slope
    assert close["stop-copy/stream"].blackout(GB) == pytest.approx(0.615 + (GB - 114 * MB) / per)
    assert rates["stop-copy/registry"].basis.startswith("default")


def test_a_tight_deadline_takes_the_fast_ways_first_then_spends_the_slack_on_less_blackout() -> None:
    # lazy as this lab measured it: flat blackout, but its pages trickle in (1 GB: ~16 s until the source is free)
    slow_lazy = {**RATES, "lazy/stream": Rate("lazy", "stream", 1.7, 0.07 * GB, 0.45, None, "test")}
    ws = [Workload("big", GB)] + [Workload(f"w{i}", 256 * MB) for i in range(4)]
    greedy_would = sum(slow_lazy["lazy/stream"].total(w.memory) for w in ws)
    p = plan(ws, [BIG], slow_lazy, 24, reserve=0.0)
    assert greedy_would > 24 and p.fits and p.end_s <= 24
    ways = {s.workload: s.mode for s in p.steps}
    assert ways["big"] == "stop-copy"  # lazy's 16 s would not leave time for the rest
    assert "lazy" in ways.values()  # the slack went to less blackout for some
    all_fast = sum(RATES["stop-copy/stream"].blackout(w.memory) for w in ws)
    assert p.total_blackout_s < all_fast
