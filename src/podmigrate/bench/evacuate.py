"""``podmigrate bench evacuate``: a node holding several workloads emptied, N times, as planned and
one at a time (the sequential baseline), alternating direction between node-a and node-b.

Every run is ``engine.evacuate``'s own evacuation; each workload's heap SHA-256 and process start
time are read before and compared after (the record's own check is not taken on trust). Per variant:
the median time to empty, its range, the median per-workload blackout, the runs that would have
met the 120, 30 and 15 s deadlines, and beside them the study's 36.8 s for one 1 GB pod.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podmigrate import cordon
from podmigrate.bench import memory, suite
from podmigrate.engine import parking
from podmigrate.engine.controller import Plan, migrate, restore
from podmigrate.engine.evacuate import Evacuation, collapsed
from podmigrate.errors import PodmigrateError
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage
from podmigrate.workload.image import ready_lab

STUDY_1GB_S = 36.8  # the study's budget for one 1 GB pod against the 120 s Spot notice
DEADLINES = (120, 30, 15)
VARIANTS = {"planned": None, "sequential": 1}  # --parallel of each: None lets the plan choose
OUTCOMES = ("moved", "parked", "restarted", "lost")  # how each workload of a run ended (failed counts as lost)


def parse_set(text: str) -> list[tuple[str, int, bool]]:
    """``4x256,1x1024,pod64`` -> [(name, heap MB, as a pod with a sidecar), ...]."""
    out: list[tuple[str, int, bool]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        pod = part.startswith("pod")
        count, _, mb = part[3:].rpartition("x") if pod else part.rpartition("x")
        try:
            n, size = int(count or 1), int(mb)
        except ValueError:
            raise PodmigrateError(f"not a workload set entry: {part!r}", hint="e.g. 4x256,1x1024,pod64") from None
        out += [(f"ev{'p' if pod else 'w'}{size}-{i}", size, pod) for i in range(n)]
    return out


def _states(lab: Lab, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: manage.state(lab, n) for n in names}


def run(
    lab: Lab,
    out_dir: Path,
    workloads: str = "4x256,1x1024,pod64",
    runs: int = 2,
    deadline_s: float = 120.0,
    report: Callable[[str], None] = lambda _m: None,
    warm_memory_gib: float | None = 0,  # None: what the runs touch (bench.memory.warm)
) -> dict[str, Any]:
    ready_lab(lab, nodes=2, report=report)
    out_dir.mkdir(parents=True, exist_ok=True)
    warmed = (
        memory.warm(warm_memory_gib, memory.need_gib([sum(h for _n, h, _pod in parse_set(workloads))], copies=2))
        if warm_memory_gib != 0
        else {"gib": 0, "seconds": 0.0}
    )
    report(f"guest memory warm-up: touched {warmed['gib']} GiB in {warmed['seconds']} s")
    mach = {**suite.machine(lab), "guest_memory_warmup": warmed}
    (out_dir / "machine.json").write_text(json.dumps(mach, indent=2))
    chosen = parse_set(workloads)
    names = [n for n, _, _ in chosen]
    for name, mb, pod in chosen:
        with contextlib.suppress(PodmigrateError):  # one left by an earlier run
            manage.stop(lab, name)
        manage.start(lab, name, "node-a", mb, sidecar=pod)
    _image_everywhere(lab, names[0], report)
    rows: list[dict[str, Any]] = []
    node = "node-a"
    try:
        for i in range(runs):
            for variant, parallel in VARIANTS.items():
                other = "node-b" if node == "node-a" else "node-a"
                before = _states(lab, names)
                report(f"run {i + 1}/{runs}, {variant}: evacuating {node} to {other}")
                rec = Evacuation(lab, node, deadline_s, [other], parallel, report).run()
                # the huge pages it left for after the node was empty: waited for, outside the timing,
                # so that the next run does not compete with them
                rec["huge_pages"] = collapsed(lab, rec)
                cordon.uncordon(lab, node)
                _regroup(lab, names, other, report)  # parked ones back, leftovers over: same layout next run
                after = _states(lab, names)
                kept = {n: after[n]["sha256"] == before[n]["sha256"] and after[n]["started"] == before[n]["started"]
                        for n in names}  # fmt: skip
                rows.append({"run": i, "variant": variant, "source": node, "target": other, "kept": kept,
                             "record": rec})  # fmt: skip
                with (out_dir / "evacuations.jsonl").open("a") as f:
                    f.write(json.dumps(rows[-1], default=str) + "\n")
                node = other
    finally:
        for name in names:
            with contextlib.suppress(PodmigrateError):
                manage.stop(lab, name)
        for n in lab.nodes:
            cordon.uncordon(lab, n)
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    summary = {"workloads": workloads, "resident_bytes": _resident(rows), "runs": runs, "deadline_s": deadline_s,
               "when": when, "variants": table(rows), "study_1gb_s": STUDY_1GB_S,
               "warmed_gib": warmed["gib"]}  # fmt: skip
    (out_dir / "evacuate.json").write_text(json.dumps({**summary, "rows": rows}, indent=2, default=str) + "\n")
    (out_dir / "evacuate.md").write_text(markdown(summary) + "\n")
    return summary


def _image_everywhere(lab: Lab, name: str, report: Callable[[str], None]) -> None:
    """The workloads' image on every node before the timed runs, as on a cluster whose nodes have
    run the service: else the first evacuation alone would time its targets pulling it (4 s here,
    two validates at once each waiting for it), and the variants would not compare."""
    c = manage.locate(lab, name).container
    for n in lab.nodes:
        agent = lab.agent(n)
        try:
            got = agent.post("/v1/images", {"image": c["image"], "id": c["image_id"]})
        finally:
            agent.close()
        if not got.get("present", True):
            raise PodmigrateError(f"{n} cannot pull the workloads' image {c['image']}: {got.get('why')}")
    report(f"the workloads' image {c['image']} is on {', '.join(lab.nodes)}")


def _regroup(lab: Lab, names: list[str], node: str, report: Callable[[str], None]) -> None:
    """Every workload of the set on ``node``, outside the timing: parked ones restored there (the
    restore checks their state), what an evacuation left behind moved over (stop-copy)."""
    for e in parking.listing(lab):
        if e["workload"] in names:
            report(f"restoring parked {e['workload']} on {node}")
            restore(lab, e["workload"], node)
    for name in names:
        loc = manage.locate(lab, name)  # (a pod: its server, by which it moves whole)
        if loc.node != node:
            report(f"moving {name}, left behind, to {node}")
            migrate(lab, Plan(loc.container["name"], node, "stop-copy"))  # the default transport


def _resident(rows: list[dict[str, Any]]) -> int:
    return sum(w["memory"] for w in rows[0]["record"]["workloads"]) if rows else 0


def _met(row: dict[str, Any], deadline: float) -> bool:
    return bool(row["record"]["empty"] and row["record"]["time_to_empty_s"] <= deadline)


def table(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        rs = [r for r in rows if r["variant"] == variant]
        if not rs:
            continue
        empty = [r["record"]["time_to_empty_s"] for r in rs if r["record"]["empty"]]
        blackouts = [w["blackout_s"] for r in rs for w in r["record"]["workloads"] if w["blackout_s"] is not None]
        out[variant] = {
            "runs": len(rs),
            "emptied": len(empty),
            "time_to_empty_s": {"median": statistics.median(empty), "min": min(empty), "max": max(empty)}
            if empty
            else None,
            "median_blackout_s": statistics.median(blackouts) if blackouts else None,
            "parallel": sorted({r["record"]["parallel"] for r in rs}),
            "ways": sorted(
                {f"{w['mode']}/{w['transport']}" for r in rs for w in r["record"]["workloads"] if w["mode"]}
            ),
            "state_kept": f"{sum(all(r['kept'].values()) for r in rs)}/{len(rs)} runs",
            "outcomes": {st: sum(_ended(w) == st for r in rs for w in r["record"]["workloads"]) for st in OUTCOMES},
            "met": {str(d): sum(_met(r, d) for r in rs) for d in DEADLINES},
        }
    return out


def _ended(w: dict[str, Any]) -> str:
    """moved, parked, restarted or lost (a workload that failed to move and was stopped by the deadline)."""
    st = str(w.get("status", "moved"))
    return st if st in OUTCOMES else "lost"


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"Evacuation of {s['workloads']} ({s['resident_bytes'] / 2**30:.2f} GiB resident), {s['runs']} runs per "
        f"variant, deadline given {s['deadline_s']:.0f} s ({s['when']}; guest memory warmed first: "
        f"{s.get('warmed_gib', 0)} GiB); the study: {s['study_1gb_s']} s for one 1 GB pod.",
        "",
        "| variant | at once | ways | emptied | time to empty (median, range) | median workload blackout | "
        "state kept | within 120 / 30 / 15 s | moved / parked / restarted / lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in s["variants"].items():
        t = v["time_to_empty_s"]
        span = f"{t['median']:.1f} s ({t['min']:.1f}-{t['max']:.1f})" if t else "-"
        mb = f"{v['median_blackout_s']:.3f} s" if v["median_blackout_s"] is not None else "-"
        met = " / ".join(str(v["met"][str(d)]) for d in DEADLINES)
        at_once = ",".join(map(str, v["parallel"]))
        ends = " / ".join(str(v.get("outcomes", {}).get(st, 0)) for st in OUTCOMES)
        lines.append(f"| {name} | {at_once} | {', '.join(v['ways'])} | {v['emptied']}/{v['runs']} | {span} | {mb} | "
                     f"{v['state_kept']} | {met} of {v['runs']} | {ends} |")  # fmt: skip
    return "\n".join(lines)
