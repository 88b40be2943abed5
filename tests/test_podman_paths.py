"""Podman's own paths in the engine benchmark (``bench.podman_paths``): the one-node export/import that
issue 14's ratio is judged against, in a real lab, checked like a migration; its state check and its
``--print-stats`` reading without one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from podmigrate import layout
from podmigrate.bench import podman_paths


def _state(**kw: Any) -> dict[str, Any]:
    return {"sha256": "ab", "started": 100.0, "counter": 5, **kw}


def test_the_state_check_wants_the_same_heap_the_same_process_and_a_counter_not_backwards() -> None:
    assert podman_paths.kept(_state(), _state(counter=9)) == ("kept", True)
    assert podman_paths.kept(_state(), _state(sha256="cd")) == ("lost", False)
    assert podman_paths.kept(_state(), _state(started=200.0, counter=0)) == ("lost", True)  # a restart
    assert podman_paths.kept(_state(), _state(counter=4)) == ("lost", True)  # an older checkpoint
    assert podman_paths.kept(_state(), None) == ("unknown", False)


def test_print_stats_are_read_as_seconds_and_anything_else_as_nothing() -> None:
    out = json.dumps({"podman_checkpoint_duration": 2_500_000,
                      "container_statistics": [{"runtime_checkpoint_duration": 1_250_000}]})  # fmt: skip
    assert podman_paths._runtime_s(out, "runtime_checkpoint_duration") == 1.25
    assert podman_paths._runtime_s("not json", "a") is None
    assert podman_paths._runtime_s(json.dumps({"container_statistics": []}), "a") is None


@pytest.mark.lab
def test_podmans_export_and_import_on_one_node_keep_the_heap_and_leave_no_archive(lab: Any, workload: Any) -> None:
    w = workload("node-a", 64, ip="10.89.1.231")  # static: the import keeps it
    rec = podman_paths.podman_one_node(lab, w["name"], "node-a")
    assert (rec["state"], rec["checks"]["sha256_equal"]) == ("kept", True)
    assert set(rec["phase_s"]) == {"checkpoint", "remove", "restore"}
    assert rec["blackout_s"] > 0
    split = rec["blackout_steps"]  # drawn beside the engine's migrations: the podman commands, then the wait
    assert {"podman: checkpoint", "podman: restore"} <= set(split["steps"]) and split["window_s"] == rec["blackout_s"]
    assert sum(split["steps"].values()) + split["unaccounted_s"] == pytest.approx(split["window_s"], abs=0.005)
    # runc and CRIU's share of it, from Podman's own statistics, is part of the whole
    assert 0 < rec["runtime_s"] < sum(rec["phase_s"].values())
    left = lab.run("node-a", ["ls", "-A", layout.NODE_CHECKPOINTS]).stdout.split()
    assert not [f for f in left if f.startswith("bench-")]
    running = lab.run("node-a", ["podman", "ps", "--format", "{{.Names}}"]).stdout.split()
    assert w["name"] in running


@pytest.mark.lab
def test_podmans_registry_path_moves_the_heap_and_leaves_no_image_or_copy(lab: Any, workload: Any) -> None:
    w = workload("node-a", 64, ip="10.89.1.232")  # static: podman's create-image path keeps only those
    rec = podman_paths.podman_image(lab, w["name"], "node-a", "node-b")
    assert (rec["state"], rec["checks"]["sha256_equal"]) == ("kept", True)
    assert "LAN: route switch" in rec["blackout_steps"]["steps"]
    for node in ("node-a", "node-b"):
        images = lab.run(node, ["podman", "images", "--format", "{{.Repository}}"]).stdout
        assert "bench-image" not in images
    assert w["name"] not in lab.run("node-a", ["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()
    assert w["name"] in lab.run("node-b", ["podman", "ps", "--format", "{{.Names}}"]).stdout.split()
