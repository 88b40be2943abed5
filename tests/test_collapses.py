"""A copy's huge pages collapsed in the target agent's background (agent.collapses), and the outcome
read after the migration (engine.phases.lazy.collapsed): real threads, a scripted collapse."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from podmigrate.agent import collapses
from podmigrate.agent.collapses import Collapses
from podmigrate.engine.phases import lazy


def _blocked() -> tuple[Collapses, threading.Event, list[str]]:
    gate, calls = threading.Event(), list[str]()

    def collapse(name: str) -> dict[str, Any]:
        calls.append(name)
        assert gate.wait(10)
        return {"collapsed_bytes": 4 << 20, "failed": {}}

    return Collapses(collapse), gate, calls


def test_a_collapse_runs_behind_the_answer_and_a_second_ask_joins_it() -> None:
    jobs, gate, calls = _blocked()
    assert jobs.status("web") == {"state": "none"}
    first = jobs.start("web")
    assert first["state"] == "collapsing" and first["started"] > 0
    assert jobs.start("web")["state"] == "collapsing"  # joined: the kernel is not asked twice
    assert jobs.wait("web", timeout=0.05)["state"] == "collapsing"  # a bounded wait says so
    gate.set()
    done = jobs.wait("web")
    assert done["state"] == "done" and done["collapsed_bytes"] == 4 << 20 and done["ended"] >= done["started"]
    assert calls == ["web"]
    gate.clear()
    assert jobs.start("web")["state"] == "collapsing"  # a later restore's copy: asked again
    gate.set()
    assert jobs.wait("web")["state"] == "done" and calls == ["web", "web"]


def test_a_failed_collapse_is_recorded_not_raised() -> None:
    def collapse(name: str) -> dict[str, Any]:
        raise OSError(3, "No such process")

    jobs = Collapses(collapse)
    jobs.start("gone")
    out = jobs.wait("gone")
    assert out["state"] == "failed" and "No such process" in out["error"]


def test_only_the_newest_finished_outcomes_are_kept(monkeypatch: Any) -> None:
    monkeypatch.setattr(collapses, "KEEP", 2)
    jobs = Collapses(lambda name: {"collapsed_bytes": 0})
    for n in ("a", "b", "c", "d"):
        jobs.start(n)
        jobs.wait(n)
    jobs.start("e")
    jobs.wait("e")
    kept = [n for n in "abcde" if jobs.status(n)["state"] != "none"]
    assert kept[-1] == "e" and len(kept) <= 3 and "a" not in kept


class _Agent:
    def __init__(self, answers: list[dict[str, Any]]):
        self.answers, self.asked = answers, list[str]()

    def get(self, path: str) -> dict[str, Any]:
        self.asked.append(path)
        return self.answers[min(len(self.asked), len(self.answers)) - 1]


def test_the_outcome_is_read_once_the_background_collapse_ended(monkeypatch: Any) -> None:
    monkeypatch.setattr(lazy, "_pause", lambda s: None)
    agent = _Agent([{"state": "collapsing"}, {"state": "collapsing"}, {"state": "done", "collapsed_bytes": 8}])
    cluster = SimpleNamespace(agent=lambda node: agent)
    rec = {"target": "node-b", "container": "web", "huge_pages": {"state": "collapsing"}}
    assert lazy.collapsed(cluster, rec)["collapsed_bytes"] == 8
    assert agent.asked == ["/v1/containers/web/huge-pages"] * 3
    # nothing started (an old path, a failed ask): the record's own entry, no agent asked
    for entry in ({}, {"error": "agent node-b: no such route"}, {"collapsed_bytes": 2}):
        assert lazy.collapsed(cluster, {**rec, "huge_pages": entry}) == entry
    assert len(agent.asked) == 3
