"""Issue 33's targets for ``bench k8s``: the Kubernetes path against the lab engine's same modes on
the same nodes in the same run, and against the same run's Kubernetes cold restart.

Every figure is a median blackout a client saw (the Kubernetes rows: ``kube.prober`` through the
Service's NodePort; the engine rows: the engine's own prober from the same LAN, same rate, same
timeout). A target whose numerator or denominator was not measured in the run does not hold: it is
shown with what is missing, never left out. The lab engine runs the same stream-server with Podman
beside the cluster (``engine.controller.migrate``); its rows are named ``engine ...``.
"""

from __future__ import annotations

from typing import Any

from podmigrate.errors import PodmigrateError
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage

# label -> (mode, transport) of the lab engine's plan
ENGINE = {
    "engine stop-copy/stream": ("stop-copy", "stream"),
    "engine lazy": ("lazy", "stream"),
    "engine cold": ("cold", "none"),
}
# the Kubernetes methods that keep state, held against the Kubernetes cold restart at 64 MB
KEEPING = ("decoupled/cri", "decoupled/runtimeclass", "stop-copy/cri", "stop-copy/runtimeclass", "stream", "lazy")
LIMIT = 1.5
DECOUPLED_RUNS = 10


def engine_one(lab: Lab, workload: str, method: str, heap_mb: int, index: int) -> dict[str, Any]:
    """Move the engine's ``workload`` to the other node with ``method``; a row shaped like
    ``bench.k8s.one``'s (the engine's prober is the client)."""
    from podmigrate.engine.controller import Plan, migrate

    mode, transport = ENGINE[method]
    source = manage.locate(lab, workload).node
    target = next(n for n in lab.nodes if n != source)
    row: dict[str, Any] = {"method": method, "mode": mode, "path": "engine", "heap_mb": heap_mb, "run": index,
                           "source": source, "target": target, "drift_s": None, "client_went_back": 0}  # fmt: skip
    try:
        rec = migrate(lab, Plan(workload, target, mode, transport))
    except PodmigrateError as e:
        return {**row, "phase": "RolledBack", "message": e.message, "total_s": None, "phase_s": {},
                "blackout_s": None, "client_blackout_s": None, "bytes": None}  # fmt: skip
    checks = rec.get("checks") or {}
    return {
        **row, "phase": "Completed", "message": "", "phase_s": rec.get("phase_s", {}),
        "total_s": sum(rec.get("phase_s", {}).values()), "blackout_s": rec.get("blackout_s"),
        "client_blackout_s": rec.get("blackout_s"), "bytes": rec.get("bytes_moved"),
        "sha256_equal": bool(checks.get("sha256_equal")), "same_process": bool(checks.get("same_process_start")),
        "blackout_steps": rec.get("blackout_steps"),
    }  # fmt: skip


def _median(table: list[dict[str, Any]], heap: int, method: str) -> float | None:
    for t in table:
        if t["heap_mb"] == heap and t["method"] == method and t.get("pleg", "generic") == "generic" and t["completed"]:
            return float(t["client_blackout_s"]["median"])
    return None


def ratios(table: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of issue 33: what it compares, the ratio, and whether it holds."""
    heaps = sorted({t["heap_mb"] for t in table})
    out: list[dict[str, Any]] = []

    def target(what: str, heap: int, num: str, den: str, limit: float) -> None:
        a, b = _median(table, heap, num), _median(table, heap, den)
        missing = [m for m, v in ((num, a), (den, b)) if v is None]
        ratio = round(a / b, 3) if a is not None and b else None
        out.append({"target": what, "heap_mb": heap, "numerator": num, "denominator": den, "limit": limit,
                    "numerator_s": a, "denominator_s": b, "ratio": ratio,
                    "holds": ratio is not None and ratio <= limit,
                    "missing": [f"{m}: not measured at {heap} MB in this run" for m in missing]})  # fmt: skip

    for heap in (h for h in (64, 1024) if h in heaps):
        target(
            "Kubernetes stream <= 1.5x the engine's stop-copy/stream", heap, "stream", "engine stop-copy/stream", LIMIT
        )
    if 1024 in heaps:
        target("Kubernetes lazy <= 1.5x the engine's lazy", 1024, "lazy", "engine lazy", LIMIT)
        target("Kubernetes lazy <= the Kubernetes cold restart", 1024, "lazy", "cold", 1.0)
    if 64 in heaps:
        for m in KEEPING:
            target(f"{m} <= 1.5x the Kubernetes cold restart", 64, m, "cold", LIMIT)
    decoupled = [r for r in rows if not r.get("warmup") and r.get("mode") == "decoupled" and r.get("path") != "engine"]
    failed = [r for r in decoupled if r.get("phase") != "Completed" or r.get("cutover_failed_probes")]
    out.append({"target": f"decoupled: no failed probe at the cutover in {DECOUPLED_RUNS} runs", "heap_mb": None,
                "runs": len(decoupled), "runs_with_failed_probes": len(failed),
                "holds": len(decoupled) >= DECOUPLED_RUNS and not failed,
                "missing": [f"{DECOUPLED_RUNS - len(decoupled)} more decoupled runs"]
                if len(decoupled) < DECOUPLED_RUNS else []})  # fmt: skip
    return out


def markdown(targets: list[dict[str, Any]]) -> list[str]:
    lines = [
        "### Targets (issue 33): ratios of median client blackouts in this run",
        "",
        "| target | heap MB | numerator s | denominator s | ratio | limit | holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        if "ratio" in t:
            shown = f"{t['ratio']:.2f}" if t["ratio"] is not None else "; ".join(t["missing"])
            a = f"{t['numerator_s']:.3f}" if t["numerator_s"] is not None else "not measured"
            b = f"{t['denominator_s']:.3f}" if t["denominator_s"] is not None else "not measured"
            lines.append(f"| {t['target']} | {t['heap_mb']} | {a} | {b} | {shown} | {t['limit']} | "
                         f"{'yes' if t['holds'] else 'NO'} |")  # fmt: skip
        else:
            got = f"{t['runs_with_failed_probes']} of {t['runs']} runs had one" + (
                f"; {'; '.join(t['missing'])}" if t["missing"] else ""
            )
            lines.append(f"| {t['target']} | all |  |  | {got} |  | {'yes' if t['holds'] else 'NO'} |")
    lines.append("")
    return lines
