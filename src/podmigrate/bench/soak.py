"""Soak: many migrations in a row, several workloads at once, every mode and transport, and what is left.

``podmigrate bench soak --migrations N --workloads K``: K workloads start on node-a; K threads each
move their own workload back and forth, cycling through the methods, until N migrations ran in all
(so K of them run at the same time on the same two nodes: the concurrency the node-wide CRIU lock,
the per-workload claims and the reservation cap exist for). Per migration: completed or not, heap
SHA-256 and process start time kept (cold: a fresh process, as it should), blackout. At the end:
what ``gc --dry-run`` would collect (leftovers), and each agent's resident memory before and after
(growth). Results: ``soak.jsonl`` (one row per migration) and ``soak.json``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podmigrate.bench import stats
from podmigrate.engine import gc
from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import PodmigrateError
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage
from podmigrate.workload.image import ready_lab

METHODS = (
    ("stop-copy", "stream"),
    ("decoupled", "stream"),
    ("stop-copy", "registry"),
    ("lazy", "stream"),
    ("decoupled", "registry"),
    ("stop-copy", "archive"),
    ("cold", "none"),
)


def agent_rss(lab: Lab) -> dict[str, int]:
    """Each agent's resident memory (its process on the node, found by the pid it reports)."""
    out = {}
    for node in lab.nodes:
        agent = lab.agent(node)
        try:
            pid = agent.get("/v1/info")["pid"]
        finally:
            agent.close()
        status = lab.run(node, ["cat", f"/proc/{pid}/status"]).stdout
        out[node] = next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS:"))
    return out


def run(
    lab: Lab,
    out_dir: Path,
    migrations: int = 200,
    workloads: int = 3,
    heap_mb: int = 32,
    report: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    ready_lab(lab, nodes=2, report=report)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [f"soak-{i}" for i in range(workloads)]
    for name in names:
        with contextlib.suppress(PodmigrateError):  # one left by an earlier soak
            manage.stop(lab, name)
        manage.start(lab, name, "node-a", heap_mb)
    rss_before = agent_rss(lab)
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    budget = itertools.count()

    def worker(name: str, offset: int) -> None:
        node = "node-a"
        for k in itertools.count(offset):
            n = next(budget)
            if n >= migrations:
                return
            mode, transport = METHODS[k % len(METHODS)]
            target = "node-b" if node == "node-a" else "node-a"
            before = manage.state(lab, name)
            row: dict[str, Any] = {"n": n, "workload": name, "mode": mode, "transport": transport,
                                   "source": node, "target": target, "started": time.time()}  # fmt: skip
            try:
                rec = migrate(lab, Plan(workload=name, target=target, mode=mode, transport=transport))
                after = manage.state(lab, name)
                row.update(ok=True, blackout_s=rec.get("blackout_s"),
                           sha256_kept=after["sha256"] == before["sha256"],
                           same_process=after.get("started") == before.get("started"))  # fmt: skip
                node = target
            except PodmigrateError as e:
                row.update(ok=False, error=e.message)
                node = manage.locate(lab, name).node  # rolled back, or wherever it serves
            row["ended"] = time.time()
            with lock:
                rows.append(row)
                with open(out_dir / "soak.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                report(f"{len(rows)}/{migrations} {name} {mode}/{transport} -> {row['target']}: "
                       f"{'ok' if row['ok'] else 'FAILED ' + row['error'][:120]}")  # fmt: skip

    threads = [threading.Thread(target=worker, args=(name, i)) for i, name in enumerate(names)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = gc.collect(lab, dry_run=True)
    rss_after = agent_rss(lab)
    for name in names:
        manage.stop(lab, name)
    stateful = [r for r in rows if r["ok"] and r["mode"] != "cold"]
    result = {
        "migrations": len(rows),
        "workloads": workloads,
        "heap_mb": heap_mb,
        "seconds": round(time.time() - t0, 1),
        "ok": sum(1 for r in rows if r["ok"]),
        "failed": [r for r in rows if not r["ok"]],
        "state_kept": sum(1 for r in stateful if r["sha256_kept"] and r["same_process"]),
        "state_lost": sum(1 for r in stateful if not (r["sha256_kept"] and r["same_process"])),
        "cold_fresh": sum(1 for r in rows if r["ok"] and r["mode"] == "cold" and not r["same_process"]),
        "blackout_s": {
            f"{m}/{t}": stats.describe(
                [
                    r["blackout_s"]
                    for r in rows
                    if r["ok"] and r["mode"] == m and r["transport"] == t and r.get("blackout_s") is not None
                ]
            )
            for m, t in METHODS
        },
        "leftovers": left,
        "agent_rss_bytes": {"before": rss_before, "after": rss_after},
    }
    (out_dir / "soak.json").write_text(json.dumps(result, indent=2))
    return result
