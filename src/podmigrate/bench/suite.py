"""The suite: N migrations per mode alternating direction, plus M cold restarts, resumable.

Rows go to ``suite.jsonl`` in the results directory as they are measured (a rerun of the same
command continues where it stopped); warm-up runs are kept and marked. One probe log per group is
copied next to them for the report's timelines. ``report`` reads these; ``engine`` borrows ``machine``.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from podmigrate.bench import memory
from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import UsageError
from podmigrate.lab.cluster import Lab, Report
from podmigrate.workload import manage

GROUPS = {
    "decoupled": ("decoupled", "stream"),
    "stop-copy": ("stop-copy", "stream"),
    "lazy": ("lazy", "stream"),
    "stop-copy-registry": ("stop-copy", "registry"),
    "cold": ("cold", "none"),
}
WORKLOAD = "suite"


def machine(lab: Lab) -> dict[str, Any]:
    with open("/proc/meminfo") as f:
        mem_kb = next((int(ln.split()[1]) for ln in f if ln.startswith("MemTotal")), 0)
    agent = lab.agent(lab.nodes[0])
    try:
        info = agent.get("/v1/info")
    finally:
        agent.close()
    return {
        "kernel": platform.release(),
        "cores": __import__("os").cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "criu": info.get("criu"),
        "podman": info.get("podman"),
        "runc": info.get("runc"),
        "python": platform.python_version(),
    }


def load(out_dir: Path) -> list[dict[str, Any]]:
    """The suite's rows; a damaged line is an error that names it (a run killed mid-write leaves one)."""
    f = out_dir / "suite.jsonl"
    if not f.exists():
        return []
    rows = []
    for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(
                f"{f}, line {n}, is not a JSON record ({e.msg}): {line[:80]!r}",
                hint="a run interrupted while writing leaves a partial last line: delete that line "
                "(the suite resumes from the rows before it), then run the report again",
            ) from None
        if not isinstance(row, dict) or "group" not in row or "blackout_s" not in row:
            raise UsageError(f"{f}, line {n}, is not a suite row (no group or blackout_s)",
                             hint="is this a podmigrate suite's results directory?")  # fmt: skip
        rows.append(row)
    return rows


def run(
    lab: Lab,
    out_dir: Path,
    runs: int = 36,
    cold: int = 20,
    heap_mb: int = 64,
    groups: tuple[str, ...] = ("decoupled", "stop-copy"),
    warmup: int = 2,
    report: Report = lambda _m: None,
    warm_memory_gib: float | None = 0,  # None: what the runs touch (bench.memory.warm)
) -> list[dict[str, Any]]:
    unknown = [g for g in groups if g not in GROUPS or g == "cold"]
    if unknown:
        raise UsageError(
            f"unknown suite group(s): {', '.join(unknown)}",
            hint=f"choose from {', '.join(g for g in GROUPS if g != 'cold')}",
        )
    lab.require_up()
    out_dir.mkdir(parents=True, exist_ok=True)
    warmed = (
        memory.warm(warm_memory_gib, memory.need_gib([heap_mb])) if warm_memory_gib != 0 else {"gib": 0, "seconds": 0.0}
    )
    report(f"guest memory warm-up: touched {warmed['gib']} GiB in {warmed['seconds']} s")
    mach = {**machine(lab), "heap_mb": heap_mb, "guest_memory_warmup": warmed}
    (out_dir / "machine.json").write_text(json.dumps(mach, indent=2))
    rows = load(out_dir)
    try:
        manage.locate(lab, WORKLOAD)
    except UsageError:
        manage.start(lab, WORKLOAD, lab.nodes[0], heap_mb, report=report)
    plan_list = [(g, GROUPS[g], runs) for g in groups] + [("cold", GROUPS["cold"], cold)]
    total = sum(warmup + n for *_x, n in plan_list)
    for group, (mode, transport), n in plan_list:
        done = [r for r in rows if r["group"] == group]
        for i in range(len(done), warmup + n):
            source = manage.locate(lab, WORKLOAD).node
            target = next(x for x in lab.nodes if x != source)
            is_warm = i < warmup
            report(
                f"{group} {'warm-up' if is_warm else 'run'} {i + 1 - (0 if is_warm else warmup)} "
                f"({len(rows) + 1}/{total}) {source} -> {target}"
            )
            rec = migrate(lab, Plan(workload=WORKLOAD, target=target, mode=mode, transport=transport))
            row = {
                "group": group,
                "run": i,
                "warmup": is_warm,
                "id": rec["id"],
                "t": time.time(),
                "direction": f"{source}->{target}",
                "heap_mb": heap_mb,
                "blackout_s": rec["blackout_s"],
                "blackout_cutover_s": rec.get("blackout_cutover_s"),
                "drift_counter": (rec.get("drift") or {}).get("counter"),
                "drift_s": (rec.get("drift") or {}).get("since_checkpoint_s"),
                "failed_probes": (rec.get("blackout") or {}).get("failed"),
                "schedule_error_max_s": (rec.get("blackout") or {}).get("schedule_error_max_s"),
                "counter_backwards": ((rec.get("blackout") or {}).get("counters") or {}).get("went_backwards"),
                "state": rec.get("state"),
                "sha256_equal": (rec.get("checks") or {}).get("sha256_equal"),
                "phase_s": rec.get("phase_s", {}),
            }
            rows.append(row)
            with open(out_dir / "suite.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            probe_log = Path((rec.get("probe") or {}).get("log", ""))
            if not is_warm and probe_log.is_file() and not (out_dir / f"probe-{group}.json").exists():
                shutil.copy(probe_log, out_dir / f"probe-{group}.json")
                (out_dir / f"probe-{group}.meta.json").write_text(
                    json.dumps(
                        {
                            "id": rec["id"],
                            "freeze_started": rec.get("freeze_started"),
                            "cutover": (rec.get("cutover") or {}).get("switches", [{}])[0].get("started"),
                        }
                    )
                )
    manage.stop(lab, WORKLOAD)
    return rows
