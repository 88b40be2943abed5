"""A migration's status writes inside its blackout go to a thread (``k8s.statuswriter``), on the
in-memory fake API (``tests/fake_kube.py``): they do not wait for the API server, land in order, and
the resource's deletion is read from their answers instead of a read per phase."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from podmigrate.k8s import api as k
from podmigrate.k8s.agents import Config
from podmigrate.k8s.context import Cancelled, Ctx, K8sRecord

from .fake_kube import FakeKubeAPI

NS = "default"
PLM = k.migrations(NS, "m1")


class GatedAPI(FakeKubeAPI):
    """Patches wait at ``gate`` once it is cleared; every call is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.patches: list[dict[str, Any]] = []
        self.gets = 0

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        assert self.gate.wait(10)
        self.patches.append(patch)
        return super().patch(path, patch)

    def get(self, path: str) -> dict[str, Any] | None:
        self.gets += 1
        return super().get(path)


@pytest.fixture
def ctx() -> Ctx:
    api = GatedAPI()
    api.objects[PLM] = {"metadata": {"name": "m1", "uid": "u-1"}, "status": {}}
    rec = K8sRecord(id="m1-id", status="running")
    return Ctx(api, None, Config(), NS, "m1", {}, rec, lambda *e: None)  # type: ignore[arg-type]


def status(ctx: Ctx) -> dict[str, Any]:
    got: dict[str, Any] = (ctx.api.get(PLM) or {})["status"]
    return got


def test_outside_the_blackout_a_write_is_made_before_save_returns(ctx: Ctx) -> None:
    ctx.rec["phase"] = "page-server"
    ctx.save(message="page-server running")
    assert status(ctx)["record"]["phase"] == "page-server"


def test_inside_the_blackout_writes_do_not_wait_and_land_in_order_merged(ctx: Ctx) -> None:
    api: GatedAPI = ctx.api  # type: ignore[assignment]
    ctx.rec["frozen_at"] = 1.0
    api.gate.clear()  # the API server does not answer
    ctx.rec["phase"] = "checkpoint"
    ctx.save(message="checkpoint done", phaseTimings={"checkpoint": 0.3})
    ctx.rec["phase"] = "restore"
    ctx.save(message="restore running")
    ctx.rec["phase"] = "cutover"
    ctx.save(message="cutover running")  # none of the three waited
    assert status(ctx) == {}
    api.gate.set()
    assert ctx.writes.flush(10) is None
    # the first alone, then the two queued behind it as one patch: the later fields win
    assert len(api.patches) == 2
    got = status(ctx)
    assert got["record"]["phase"] == "cutover"
    assert got["message"] == "cutover running"
    assert got["phaseTimings"] == {"checkpoint": 0.3}


def test_the_record_written_is_the_one_saved_not_its_later_changes(ctx: Ctx) -> None:
    api: GatedAPI = ctx.api  # type: ignore[assignment]
    ctx.rec["frozen_at"] = 1.0
    api.gate.clear()
    ctx.rec["phase"] = "restore"
    ctx.save()
    ctx.rec["phase"] = "changed after the save"
    api.gate.set()
    ctx.writes.flush(10)
    assert status(ctx)["record"]["phase"] == "restore"


def test_after_the_cutover_a_write_waits_for_the_queued_ones_and_comes_last(ctx: Ctx) -> None:
    api: GatedAPI = ctx.api  # type: ignore[assignment]
    ctx.rec["frozen_at"] = 1.0
    api.gate.clear()
    ctx.save(message="restore running")
    ctx.rec["cutover_at"] = 2.0
    threading.Timer(0.2, api.gate.set).start()
    ctx.save(message="cutover done")  # synchronous again: after the queued one
    assert status(ctx)["message"] == "cutover done"
    assert status(ctx)["record"]["cutover_at"] == 2.0


def test_a_deletion_inside_the_blackout_is_read_from_the_writes_answer(ctx: Ctx) -> None:
    api: GatedAPI = ctx.api  # type: ignore[assignment]
    ctx.rec["frozen_at"] = 1.0
    ctx.check_cancelled()  # not deleted, and nothing read
    api.objects[PLM]["metadata"]["deletionTimestamp"] = "2026-12-07T18:00:00Z"
    ctx.check_cancelled()  # no write has answered since: not known yet
    assert api.gets == 0
    ctx.save(message="restore running")
    ctx.writes.flush(10)
    with pytest.raises(Cancelled, match="m1 was deleted while it ran"):
        ctx.check_cancelled()
    assert api.gets == 0


def test_a_resource_gone_inside_the_blackout_counts_as_deleted(ctx: Ctx) -> None:
    ctx.rec["frozen_at"] = 1.0
    del ctx.api.objects[PLM]  # type: ignore[attr-defined]
    ctx.save(message="restore running")
    assert "404" in (ctx.writes.flush(10) or "")
    with pytest.raises(Cancelled):
        ctx.check_cancelled()


def test_outside_the_blackout_a_deletion_is_read_from_the_api(ctx: Ctx) -> None:
    api: GatedAPI = ctx.api  # type: ignore[assignment]
    api.objects[PLM]["metadata"]["deletionTimestamp"] = "2026-12-07T18:00:00Z"
    with pytest.raises(Cancelled):
        ctx.check_cancelled()
    assert api.gets == 1


def test_a_rollback_writes_synchronously_even_while_frozen(ctx: Ctx) -> None:
    api: GatedAPI = ctx.api  # type: ignore[assignment]
    ctx.rec["frozen_at"] = 1.0
    ctx.rec["status"] = "rolling_back"
    ctx.save(message="rolling back")
    assert status(ctx)["message"] == "rolling back"
    assert len(api.patches) == 1
