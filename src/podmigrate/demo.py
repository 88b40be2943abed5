"""The main job: a lab, a stateful workload, a migration there and back, and the evidence.

``run`` starts (or reuses) the lab, starts stream-server with a heap of ``heap_mb`` on node-a,
migrates it to node-b and back, checks that the heap digest never changed and the counter never
went backwards, and writes both migration records and a Markdown summary to ``out_dir``. It uses
``workload`` (the lab with its image, the workload), ``engine.controller`` (the migrations) and
``bench.suite`` / ``bench.report`` (the short suite at the end); ``podmigrate demo`` (``cli.bench``) runs it.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import UsageError
from podmigrate.lab.cluster import Lab, Report
from podmigrate.workload import manage
from podmigrate.workload.image import ready_lab


def machine() -> dict[str, Any]:
    with open("/proc/meminfo") as f:
        mem = next((ln.split()[1] for ln in f if ln.startswith("MemTotal")), "0")
    return {
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem) / 2**20, 1),
        "python": platform.python_version(),
    }


def run(
    lab: Lab, heap_mb: int, out_dir: Path, name: str = "demo", report: Report = lambda _m: None, suite_runs: int = 3
) -> dict[str, Any]:
    ready_lab(lab, nodes=max(2, len(lab.nodes) if lab.is_up() else 2), report=report)
    try:
        manage.stop(lab, name)
        report(f"removed an earlier {name!r}")
    except UsageError:
        pass
    report(f"starting stream-server {name!r} with a {heap_mb} MB heap on node-a")
    start = manage.start(lab, name, "node-a", heap_mb)
    records = []
    for target in ("node-b", "node-a"):
        report(f"migrating {name!r} to {target}")
        # the default transport (engine.plans.DEFAULT_TRANSPORT, as `podmigrate migrate`'s): stream,
        # the fastest with zero drift
        records.append(migrate(lab, Plan(workload=name, target=target), report))
    final = manage.state(lab, name)
    digests = [start["sha256"], *(r["state_after"]["sha256"] for r in records), final["sha256"]]
    counters = [
        start["counter"],
        *(c for r in records for c in (r["state_before"]["counter"], r["state_after"]["counter"])),
        final["counter"],
    ]
    nodes = records[0]["nodes"]
    summary = {
        "heap_mb": heap_mb,
        "machine": {**machine(), **next(iter(nodes.values()))},
        "digests_identical": len(set(digests)) == 1,
        "counter_never_backwards": all(a <= b for a, b in itertools.pairwise(counters)),
        "sha256": start["sha256"],
        "counters": counters,
        "migrations": [
            {
                k: r.get(k)
                for k in (
                    "id",
                    "source",
                    "target",
                    "status",
                    "blackout_s",
                    "blackout_method",
                    "phase_s",
                    "bytes_moved",
                    "throughput_mb_s",
                    "checks",
                )
            }
            for r in records
        ],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(records):
        (out_dir / f"migration-{i + 1}-{r['source']}-to-{r['target']}.json").write_text(json.dumps(r, indent=2))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "summary.md").write_text(markdown(summary))
    manage.stop(lab, name)
    if suite_runs:
        # a short version of the full suite (`podmigrate bench suite`): a few runs per mode, small heap
        from podmigrate.bench import report as report_mod
        from podmigrate.bench import suite

        report(f"short suite: {suite_runs} migrations per mode and {max(1, suite_runs - 1)} cold restarts, 64 MB")
        suite.run(
            lab,
            out_dir / "suite",
            runs=suite_runs,
            cold=max(1, suite_runs - 1),
            heap_mb=64,
            groups=("decoupled", "stop-copy", "lazy"),
            warmup=1,
            report=report,
        )
        summary["suite_report"] = str(out_dir / "suite" / "report.md")
        summary["suite"] = {g: round(d["median"], 3) for g, d in report_mod.build(out_dir / "suite")["groups"].items()}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def markdown(s: dict[str, Any]) -> str:
    phases = list(s["migrations"][0]["phase_s"])
    lines = [
        f"# podmigrate demo: {s['heap_mb']} MB heap, node-a -> node-b -> node-a",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}; machine: {s['machine']}",
        "",
        "| migration | blackout (s) | " + " | ".join(f"{p} (s)" for p in phases) + " | moved (MiB) |",
        "|---|---|" + "---|" * len(phases) + "---|",
    ]
    for m in s["migrations"]:
        lines.append(
            f"| {m['source']} -> {m['target']} | {m['blackout_s']:.3f} | "
            + " | ".join(f"{m['phase_s'][p]:.3f}" for p in phases)
            + f" | {m['bytes_moved'] / 2**20:.0f} |"
        )
    lines += [
        "",
        f"Heap SHA-256 {s['sha256']}: identical at every step: **{s['digests_identical']}**",
        f"Counter readings {s['counters']}: never went backwards: **{s['counter_never_backwards']}**",
        "",
    ]
    return "\n".join(lines)


def run_kubernetes(lab_name: str, heap_mb: int, out_dir: Path, report: Report = lambda _m: None) -> dict[str, Any]:
    """The Kubernetes path, watched, on upstream Kubernetes in the lab (``podmigrate kube up``):
    podmigrate installed as a user installs it (``kube install``: its image, ``kubectl apply -k``), the
    user's example pod (heap server + sidecar) applied, moved to the other node by a PodLiveMigration
    restored through CRI, and back through the podmigrate RuntimeClass. ``report`` gets every phase
    change of each PodLiveMigration as it happens. The cluster stays up (``kube down`` ends it)."""
    from podmigrate.bench.k8s import ready_cluster
    from podmigrate.kube import example, install

    cluster = ready_cluster(lab_name, report)
    lab = cluster.lab
    out_dir.mkdir(parents=True, exist_ok=True)
    ns = "default"
    install.remove_example(cluster, ns)
    report(f"applying the example: pod heapsrv ({heap_mb} MB heap + sidecar), its Service and budget")
    install.apply_example(cluster, ns, heap_mb)
    here = example.ready_pod(cluster, ns, "heapsrv", 300 + heap_mb / 4)
    start = example.state(cluster, here, 120 + heap_mb / 4)
    moves: list[dict[str, Any]] = []
    pod, node = "heapsrv", here["spec"]["nodeName"]
    for i, path in enumerate(("cri", "runtimeclass")):
        target = next(n for n in lab.nodes if n != node)
        name = f"heapsrv-to-{target.removeprefix('node-')}-{i}"
        report(f"kubectl apply PodLiveMigration {name}: {pod} {node} -> {target}, restorePath {path}")
        spec = {"podName": pod, "targetNode": target, "restorePath": path, "service": "heapsrv",
                "timeouts": {"checkpointSeconds": 600, "restoreSeconds": 600}}  # fmt: skip
        example.migrate(cluster, ns, name, spec)

        def shown(st: dict[str, Any], name: str = name) -> None:
            report(f"{name}: {st.get('phase', 'Pending')}  {st.get('message', '')}")

        st = example.wait_final(cluster, ns, name, on_change=shown)
        after: dict[str, Any] = {}
        if st.get("phase") == "Completed":
            copy = example.ready_pod(cluster, ns, st["restoredPod"]["name"], 120)
            after = example.state(cluster, copy, 120 + heap_mb / 4)
        moves.append({"name": name, "from": node, "to": target, "status": st, "state_after": after})
        if st.get("phase") != "Completed":
            break
        pod, node = st["restoredPod"]["name"], target
    summary = {
        "heap_mb": heap_mb,
        "machine": machine(),
        "sha256": start["sha256"],
        "state_kept": bool(moves)
        and all(
            m["state_after"].get("sha256") == start["sha256"] and m["state_after"].get("started") == start["started"]
            for m in moves
        ),
        "migrations": [
            {
                "name": m["name"],
                "from": m["from"],
                "to": m["to"],
                "phase": m["status"].get("phase"),
                "restore_path": m["status"].get("restorePath"),
                "phase_s": m["status"].get("phaseTimings") or {},
                "blackout_s": m["status"].get("blackoutSeconds"),
                "drift_s": m["status"].get("driftSeconds"),
                "bytes": m["status"].get("bytes"),
                "message": m["status"].get("message"),
            }
            for m in moves
        ],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
