"""``bench k8s``'s bookkeeping without a cluster: rows grouped per heap, method and PLEG, the client's
blackout beside the record's, and bad methods or PLEGs refused before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from podmigrate.bench import k8s
from podmigrate.errors import LabError


def row(method: str, pleg: str, blackout: float, client: float, warmup: bool = False) -> dict[str, Any]:
    return {"heap_mb": 64, "method": method, "pleg": pleg, "phase": "Completed", "warmup": warmup,
            "blackout_s": blackout, "client_blackout_s": client, "client_went_back": 0, "drift_s": 0.0,
            "total_s": client + 1, "phase_s": {"restore": blackout / 2}, "bytes": 1, "message": "",
            "sha256_equal": True, "same_process": True}  # fmt: skip


def test_rows_are_grouped_per_pleg_and_the_client_blackout_is_kept_beside_the_record() -> None:
    sc = "stop-copy/cri"
    rows = [row(sc, "generic", 5.0, 6.0), row(sc, "generic", 7.0, 8.0), row(sc, "evented", 3.0, 4.0),
            row(sc, "evented", 99.0, 99.0, warmup=True)]  # fmt: skip
    table = k8s.summarize(rows)["table"]
    got = {t["pleg"]: (t["n"], t["blackout_s"]["median"], t["client_blackout_s"]["median"]) for t in table}
    assert got == {"generic": (2, 6.0, 7.0), "evented": (1, 3.0, 4.0)}  # the warm-up is not counted
    text = "\n".join(k8s.markdown({"table": table}))
    assert "| 64 | stop-copy/cri | evented | 1 | 1 | 1 | 3.000 | 4.000 |" in text


@pytest.mark.parametrize(("methods", "plegs"), [(["warp/cri"], ("generic",)), (["cold"], ("magic",))])
def test_an_unknown_method_or_pleg_is_refused_before_any_lab_starts(
    tmp_path: Path, methods: list[str], plegs: tuple[str, ...]
) -> None:
    with pytest.raises(LabError, match="unknown methods or PLEGs"):
        k8s.run("no-such-lab-here", tmp_path, [64], methods, 1, 0, plegs=plegs)
    assert not any(tmp_path.iterdir())


def test_each_target_is_a_ratio_of_medians_in_one_run_and_a_missing_side_never_holds() -> None:
    rows = [row("stream", "generic", 1.0, 1.2), row("stream", "generic", 1.0, 1.4),
            row("engine stop-copy/stream", "generic", 0.5, 0.6), row("cold", "generic", 3.0, 4.0),
            row("stop-copy/cri", "generic", 7.0, 8.0)]  # fmt: skip
    rows += [{**row("decoupled/cri", "generic", 0.0, 1.8), "mode": "decoupled", "cutover_failed_probes": 0}] * 9
    rows.append({**row("decoupled/cri", "generic", 0.0, 1.8), "mode": "decoupled", "cutover_failed_probes": 2})
    got = {(t["target"], t["heap_mb"]): t for t in k8s.summarize(rows)["targets"]}
    stream = got[("Kubernetes stream <= 1.5x the engine's stop-copy/stream", 64)]
    assert (stream["ratio"], stream["holds"]) == (round(1.3 / 0.6, 3), False)
    assert got[("stream <= 1.5x the Kubernetes cold restart", 64)]["holds"]  # 1.3 / 4.0
    assert not got[("stop-copy/cri <= 1.5x the Kubernetes cold restart", 64)]["holds"]  # 8.0 / 4.0
    lazy = got[("lazy <= 1.5x the Kubernetes cold restart", 64)]
    assert not lazy["holds"] and lazy["missing"] == ["lazy: not measured at 64 MB in this run"]
    decoupled = got[("decoupled: no failed probe at the cutover in 10 runs", None)]
    assert (decoupled["runs"], decoupled["runs_with_failed_probes"], decoupled["holds"]) == (10, 1, False)
    text = "\n".join(k8s.markdown(k8s.summarize(rows)))
    assert "| Kubernetes stream <= 1.5x the engine's stop-copy/stream | 64 | 1.300 | 0.600 | 2.17 | 1.5 | NO |" in text


def test_probes_in_flight_together_may_be_served_in_any_order_without_the_state_going_back() -> None:
    from podmigrate.kube.prober import blackout, went_back

    def s(t: float, dt: float, counter: int | None) -> dict[str, Any]:
        return {"t": t, "dt": dt, "ok": counter is not None, **({"counter": counter} if counter is not None else {})}

    overlapping = [s(0.00, 0.05, 10), s(0.02, 0.01, 9), s(0.04, 0.01, 11)]  # 9 was sent before 10 came back
    assert went_back(overlapping) == []
    back = [*overlapping, s(0.10, 0.01, 8)]  # sent after 10 and 11 came back: a real step back
    assert went_back(back) == [(0.10, 11, 8)]
    gap = [s(0.0, 0.01, 1), s(0.02, 1.0, None), s(0.04, 1.0, None), s(0.5, 0.01, 2)]
    assert blackout(list(reversed(gap))) == {"seconds": 0.5, "failed": 2, "from": 0.0, "to": 0.5}
