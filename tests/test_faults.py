"""Cells of the fault matrix (``podmigrate bench faults``), each fault injected for real in a controller
process of its own: afterwards the workload serves on exactly one node, routed there, with the heap
and process it had (cold: a fresh one), and ``gc --dry-run`` finds nothing left behind (real lab)."""

from __future__ import annotations

from typing import Any

import pytest

from podmigrate.bench import faults
from podmigrate.bench.faults import Cell

pytestmark = pytest.mark.lab

CELLS = [
    # past the lazy commit a signal must not stop the run: it once left the only copy unrouted
    Cell("sigterm", "restore", "lazy", "stream"),
    # a cold rollback once brought the source back on another address
    Cell("sigterm", "stop", "cold", "none"),
    Cell("controller-killed", "checkpoint", "stop-copy", "stream"),
    Cell("controller-killed", "restore", "lazy", "stream"),
    # the target's restore waited at its gate when its agent died: the next agent removes what it left
    Cell("target-agent-killed", "checkpoint", "stop-copy", "stream"),
    Cell("target-agent-killed", "checkpoint", "lazy", "stream"),
    Cell("source-agent-killed", "checkpoint", "decoupled", "stream"),
    # a lazy dump whose agent died once held podman's lock for ever: the restarted agent gives it up
    Cell("source-agent-killed", "checkpoint", "lazy", "stream"),
    Cell("link-cut", "checkpoint", "stop-copy", "registry"),
    Cell("disk-full", "validate", "stop-copy", "stream"),
    Cell("registry-down", "push", "stop-copy", "registry"),
    Cell("tampered", "transfer", "lazy", "stream"),
]


def test_the_cells_here_are_cells_of_the_benchmark_matrix():
    assert set(CELLS) <= set(faults.matrix()) and len(faults.matrix()) >= 40
    assert {c.fault for c in CELLS} == {c.fault for c in faults.matrix()}


@pytest.mark.parametrize("cell", CELLS, ids=[c.label.replace(" ", "-") for c in CELLS])
def test_a_fault_leaves_the_workload_serving_once_with_its_state_and_nothing_behind(lab, workload, cell):
    st: dict[str, Any] = workload(heap_mb=16)
    row = faults.run_cell(lab, cell, st["name"], "node-a", st)
    assert row.get("injected"), f"the controller never reached {cell.point}: {row}"
    assert row["running_on"] in (["node-a"], ["node-b"]), row
    assert row["serving"] and row["routed"], row
    assert row["state_kept"] is (None if cell.mode == "cold" else True), row
    assert row["fresh_process"] is (cell.mode == "cold"), row
    assert not any(row["leftovers"].values()), row["leftovers"]
    assert faults.verdict(row) == "ok"
    if row["running_on"] == ["node-a"]:  # it did not move: the record says it was rolled back
        assert row["outcome"] == "rolled_back", row
    else:
        assert row["outcome"] == "completed", row
