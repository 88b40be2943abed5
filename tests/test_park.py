"""Parking a container in the registry and restoring it later (``podmigrate park`` / ``restore``): in a
real lab, the heap and the process come back as they were parked; a failed restore leaves it parked;
``gc`` leaves a parked checkpoint alone. The store itself (``engine.parking``) without a lab."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from podmigrate.engine import gc, parking
from podmigrate.engine.controller import park, restore
from podmigrate.errors import MigrationFailed, UsageError
from podmigrate.transport import seal
from podmigrate.workload import manage

from .test_migration import assert_clean, node_files, registry_tags


def _entry(name: str = "web", sealed: bool = True) -> dict[str, Any]:
    return {"workload": name, "checkpoint_id": "m1", "sealed": sealed, "source": "node-a", "parked_at": 1.0}


def test_the_store_keeps_entry_and_key_owner_only_and_says_what_is_parked(tmp_path: Path) -> None:
    lab: Any = SimpleNamespace(dir=tmp_path, name="t")
    key = seal.new_key()
    parking.save(lab, _entry(), key)
    d = tmp_path / "parked"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()} == {"web.json": 0o600, "web.key": 0o600}
    assert key not in (d / "web.json").read_text()  # the key only in its own file
    entry, got = parking.load(lab, "web")
    assert got == key and entry["checkpoint_id"] == "m1"
    with pytest.raises(UsageError, match="'db' is not parked in lab 't'") as e:
        parking.load(lab, "db")
    assert e.value.hint == "parked: web"
    (d / "web.key").unlink()
    with pytest.raises(UsageError, match=r"the key that 'web'\'s parked checkpoint is sealed with is gone"):
        parking.load(lab, "web")
    parking.save(lab, _entry("db", sealed=False), None)
    assert parking.load(lab, "db")[1] is None
    assert [e["workload"] for e in parking.listing(lab)] == ["db", "web"]
    assert parking.remove(lab, "web") and not parking.remove(lab, "web")
    with pytest.raises(UsageError, match="not a valid workload name"):
        parking.save(lab, _entry("../x"), None)


@pytest.mark.lab
def test_a_parked_container_comes_back_on_another_node_with_its_heap_and_process(lab: Any, workload: Any) -> None:
    st = workload(node="node-a", heap_mb=32)
    name = st["name"]
    rec = park(lab, name)
    assert rec["status"] == "completed" and rec["transport"] == "registry" and rec["security"]["sealed"]
    assert [p["name"] for p in rec["phases"]] == ["validate", "checkpoint", "push", "park", "cleanup"]
    # nothing runs it now; its image and its entry wait, and gc leaves both (and its route) alone
    assert not any(c["name"] == name for cs in manage.inventory(lab).values() for c in cs)
    assert registry_tags(lab, f"podmigrate/checkpoints/{name}") == [rec["id"]]
    assert [e["workload"] for e in parking.listing(lab)] == [name]
    assert gc.collect(lab, dry_run=True) == {"archives": [], "images": [], "containers": [], "routes": []}
    back = restore(lab, name, "node-b")
    assert back["status"] == "completed" and back["state"] == "kept" and back["scope"] == "parked"
    assert back["checks"] == {"sha256_equal": True, "counter_not_backwards": True, "same_process_start": True}
    assert back["parked_for_s"] > 0 and back["blackout_s"] >= back["phase_s"]["restore"]
    after = manage.state(lab, name)
    assert after["node"] == "node-b" and after["sha256"] == st["sha256"] and after["started"] == st["started"]
    assert after["ip"] == st["ip"]  # its own address, routed to its new node
    assert parking.listing(lab) == [] and not (lab.dir / "parked" / f"{name}.key").exists()
    assert_clean(lab, name)


@pytest.mark.lab
def test_a_restore_that_fails_leaves_the_workload_parked_and_a_second_one_restores_it(lab: Any, workload: Any) -> None:
    st = workload(node="node-a", heap_mb=16)
    name = st["name"]
    park(lab, name)
    keyfile = lab.dir / "parked" / f"{name}.key"
    key = keyfile.read_text()
    keyfile.write_text(seal.new_key())  # another key: the image does not open with it
    with pytest.raises(MigrationFailed, match="rolled back, it is still parked") as e:
        restore(lab, name, "node-b")
    assert "not sealed for this migration" in str(e.value)
    assert [x["workload"] for x in parking.listing(lab)] == [name]
    assert node_files(lab, "node-b") == [] and len(registry_tags(lab, f"podmigrate/checkpoints/{name}")) == 1
    keyfile.write_text(key)
    with pytest.raises(UsageError, match="there is no node 'node-z'"):
        restore(lab, name, "node-z")
    back = restore(lab, name, "node-a")  # its own node is as good as any other
    assert back["state"] == "kept" and manage.state(lab, name)["sha256"] == st["sha256"]
    assert_clean(lab, name)


@pytest.mark.lab
def test_what_cannot_be_parked_or_restored_is_refused_before_anything_moves(lab: Any, workload: Any) -> None:
    pod = workload(node="node-a", heap_mb=16, sidecar=True)
    with pytest.raises(UsageError, match="a pod is not parked"):
        park(lab, pod["name"])
    with pytest.raises(UsageError, match="is not parked in lab"):
        restore(lab, pod["name"], "node-b")
    st = workload(node="node-a", heap_mb=16)
    park(lab, st["name"])
    manage.start(lab, st["name"], "node-b", 16)  # someone started a fresh one under its name meanwhile
    try:
        with pytest.raises(UsageError, match="runs on node-b already; its parked checkpoint is older"):
            restore(lab, st["name"], "node-a")
        assert [x["workload"] for x in parking.listing(lab)] == [st["name"]]
    finally:
        manage.stop(lab, st["name"])
        parking.remove(lab, st["name"])
        gc.collect(lab)  # its image, no longer parked, is a leftover now
    assert registry_tags(lab, f"podmigrate/checkpoints/{st['name']}") == []
