"""The engine benchmark's background load (``bench.load``): real mesh services in a real lab."""

from __future__ import annotations

from typing import Any

import pytest

from podmigrate.bench import load
from podmigrate.workload import manage

from .conftest import wait_for

pytestmark = pytest.mark.lab


def test_the_background_load_calls_between_services_at_its_rate_and_goes_away(lab: Any) -> None:
    mesh = load.start(lab, per_node=2, rate=20)
    try:
        assert len(mesh.services) == 2 * len(lab.nodes)
        idle = mesh.set_rate(0)
        assert all(s["rate"] == 0 and len(s["peers"]) == 1 for s in idle.values())
        mesh.on()
        # every service's calls reach its peer and succeed
        wait_for(lambda: all(s["ok"] >= 10 for s in mesh.set_rate(20).values()), 60, "the services to call each other")
        counts = mesh.set_rate(0)
        assert all(s["failed"] == 0 for s in counts.values()), counts
    finally:
        mesh.stop()
    left = {c["name"] for cs in manage.inventory(lab).values() for c in cs}
    assert not {n for n in left if n.startswith(load.PREFIX)}, left
