"""The Kubernetes path measured on upstream Kubernetes in the lab (``kube up``, podmigrate installed
as a user installs it).

Like with like against the study, whose figures are Kubernetes figures (kubelet checkpoint, image,
runtime restore, Service cutover, probed from outside the cluster): the example pod moves back and
forth between the nodes, N times per heap, mode and restore path, in one run, alternating direction.
Per migration it keeps the operator's phase times (checkpoint = the kubelet's checkpoint of every
container, package = the push, restore = pull or fetch + the pod's create and start, cutover = the
Service switch), the blackout in its record (the time the Service selected no ready pod: stop-copy
and cold) and drift (decoupled: the source served on after its checkpoint), and beside them what a
client on the LAN saw (``kube.prober``: 50 Hz through the Service's NodePort, a new connection per
probe): the longest run of failed probes and whether the state it read ever went back; bytes, and
whether the heap came over (SHA-256 and start time); every probe of a run in ``probes/<heap>-<run>.json``.
``podmigrate bench k8s`` runs it; ``report`` renders ``k8s.json``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podmigrate import layout
from podmigrate.bench import k8s_targets, stats
from podmigrate.errors import LabError, UsageError
from podmigrate.kube import example, install, kubelet
from podmigrate.kube.cluster import KubeCluster
from podmigrate.kube.prober import Prober, blackout, went_back
from podmigrate.lab.cluster import Lab
from podmigrate.polling import poll
from podmigrate.workload import manage

Report = Callable[[str], None]
PHASES = ("validate", "isolate", "checkpoint", "package", "restore", "cutover", "cleanup")
# stream: stop-copy with the agents' runc checkpoint, pages into the waiting copy (k8s.stream_phases)
# lazy: post-copy through the same waiting copy (k8s.streams_lazy)
KUBE_METHODS = (
    "decoupled/cri", "decoupled/runtimeclass", "stop-copy/cri", "stop-copy/runtimeclass", "stream", "lazy", "cold"
)  # fmt: skip
METHODS = (*KUBE_METHODS, *k8s_targets.ENGINE)
CUTOVER_WINDOW_S = 1.0  # failed probes from this long before the Service switch count as at the cutover
MARKS = (
    "isolated_at",
    "frozen_at",
    "checkpointed_at",
    "cutover_at",
    "serving_s",
    "stream",
)  # the record's times, beside the probes
NS = "default"


def k8s_lab(name: str, report: Report) -> Lab:
    """The lab ``name`` with containerd nodes: started if down, refused if it runs Podman."""
    lab = Lab(name)
    if lab.is_up() and lab.config().get("runtime") != "containerd":
        raise LabError(
            f"lab {name!r} is up with Podman; the Kubernetes path needs containerd nodes",
            hint=f"use another --lab, or: podmigrate --lab {name} lab down",
        )
    if not lab.is_up():
        lab.up(nodes=2, runtime="containerd", report=report)
    return lab


def ready_cluster(lab_name: str, report: Report) -> KubeCluster:
    """Upstream Kubernetes on lab ``lab_name`` (``kube up``) with podmigrate installed (``kube install``)."""
    cluster = KubeCluster(k8s_lab(lab_name, report))
    report("upstream Kubernetes on the lab's nodes (kube up)")
    cluster.up(report)
    install.install(cluster, report)
    return cluster


POD_SHAPES = ("sidecar", "single")
SHAPE_TEXT = {
    "sidecar": "the heap server behind its sidecar, two containers (deploy/kubernetes/examples, the study's "
    "shape; the lab engine's rows move one container)",
    "single": "the heap server alone, one container, as the lab engine's rows (`bench k8s --pod single`)",
}


def one(cluster: KubeCluster, pod: str, method: str, heap_mb: int, index: int, port: int) -> dict[str, Any]:
    """Move ``pod`` to the other node with ``method``, probed from the LAN; the row, and the pod that
    serves after it in ``row['pod']``."""
    mode, _, path = method.partition("/") if method != "stream" else ("stop-copy", "", "")
    here = example.ready_pod(cluster, NS, pod, 300 + heap_mb / 4)
    source = here["spec"]["nodeName"]
    target = next(n for n in cluster.lab.nodes if n != source)
    before = example.state(cluster, here, 120 + heap_mb / 4)
    name = f"b{index}-{mode if method != 'stream' else 'stream'}"
    spec: dict[str, Any] = {"podName": pod, "targetNode": target, "mode": mode, "service": "heapsrv",
                            "timeouts": {"checkpointSeconds": 600, "restoreSeconds": 600}}  # fmt: skip
    if path:
        spec["restorePath"] = path
    if method == "stream":
        spec["transport"] = "stream"
    with Prober(cluster.lab, layout.node_ip(cluster.lab.nodes[0]), port) as probes:
        poll(lambda: probes.answered() >= 5, 60, "the prober's first answers")
        t0 = time.time()
        example.migrate(cluster, NS, name, spec)
        st = example.wait_final(cluster, NS, name, timeout=1800)
        ended = time.time()

        def after_it() -> bool:
            return sum(1 for s in probes.samples if s["ok"] and s["t"] > ended) >= 10

        poll(after_it, 120, "answers after the migration")
    cutover_at = (st.get("record") or {}).get("cutover_at")
    row: dict[str, Any] = {
        "method": method, "mode": mode, "path": st.get("restorePath") or path or None, "heap_mb": heap_mb,
        "run": index, "source": source, "target": target, "phase": st.get("phase"), "total_s": ended - t0,
        "phase_s": st.get("phaseTimings") or {}, "blackout_s": st.get("blackoutSeconds"),
        "drift_s": st.get("driftSeconds"), "bytes": st.get("bytes"), "message": st.get("message", ""),
        "client_blackout_s": blackout(probes.samples)["seconds"], "client_went_back": len(went_back(probes.samples)),
        "probes": len(probes.samples),
        "cutover_failed_probes": _failed_since(probes.samples, cutover_at - CUTOVER_WINDOW_S) if cutover_at else None,
    }  # fmt: skip
    if st.get("phase") == "Completed":
        copy = example.ready_pod(cluster, NS, st["restoredPod"]["name"], 300)
        after = example.state(cluster, copy, 120 + heap_mb / 4)
        row["sha256_equal"] = after["sha256"] == before["sha256"]
        row["same_process"] = after["started"] == before["started"]
        row["pod"] = st["restoredPod"]["name"]
    else:
        row["pod"] = pod  # rolled back: the source serves on
    cluster.kubectl(["delete", "plm", name, "-n", NS], check=False)
    rec = st.get("record") or {}
    row["_probes"] = {"samples": probes.samples, "record": {k: rec.get(k) for k in MARKS if k in rec}}
    return row


def _failed_since(samples: list[dict[str, Any]], t: float) -> int:
    return sum(1 for s in samples if not s["ok"] and s["t"] >= t)


def run(
    lab_name: str,
    out_dir: Path,
    heaps: list[int],
    methods: list[str],
    runs: int,
    warmup: int = 1,
    report: Report = lambda _m: None,
    plegs: tuple[str, ...] = ("generic",),
    pod_shape: str = "sidecar",
) -> dict[str, Any]:
    """``plegs``: the kubelets' PLEG for each round of methods, interleaved (each switch restarts them).
    ``pod_shape``: the example as it is (``sidecar``: the server behind its sidecar, the study's
    shape) or its server alone (``single``: one container, as the lab engine's workload)."""
    if pod_shape not in POD_SHAPES:
        raise LabError(f"unknown pod shape {pod_shape!r}", hint=f"one of {', '.join(POD_SHAPES)}")
    unknown = sorted(set(methods) - set(METHODS)) + sorted(set(plegs) - set(kubelet.PLEGS))
    if unknown:
        raise LabError(f"unknown methods or PLEGs {unknown}",
                       hint=f"methods: {', '.join(METHODS)}; PLEGs: {', '.join(kubelet.PLEGS)}")  # fmt: skip
    cluster = ready_cluster(lab_name, report)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for heap in heaps:
        install.remove_example(cluster, NS)
        report(f"{heap} MB: the example pod (kube example)")
        install.apply_example(cluster, NS, heap, sidecar=pod_shape == "sidecar")
        port = int(example.get(cluster, "service", "heapsrv", "-n", NS)["spec"]["ports"][0]["nodePort"])
        pod, index = "heapsrv", 0
        workload = f"k8sbench{heap}"
        if engine := [m for m in methods if m in k8s_targets.ENGINE]:
            report(f"{heap} MB: the lab engine's stream-server beside it ({', '.join(engine)})")
            with contextlib.suppress(UsageError):
                manage.stop(cluster.lab, workload)
            manage.start(cluster.lab, workload, cluster.lab.nodes[0], heap, report=report)
        for r, pleg in ((r, p) for r in range(warmup + runs) for p in plegs):
            cluster.set_pleg(pleg, report)
            for method in methods:  # interleaved: the machine's drift hits every method alike
                index += 1
                if method in k8s_targets.ENGINE:
                    row = k8s_targets.engine_one(cluster.lab, workload, method, heap, index)
                else:
                    row = one(cluster, pod, method, heap, index, port)
                row["warmup"], row["pleg"] = r < warmup, pleg
                if probes := row.pop("_probes", None):  # each answer, for what a summary cannot show
                    (out_dir / "probes").mkdir(exist_ok=True)
                    (out_dir / "probes" / f"{heap}-{index}.json").write_text(json.dumps({"row": row, **probes}))
                rows.append(row)
                with open(out_dir / "k8s.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                which = r + 1 - warmup if r >= warmup else "warm-up"
                report(f"{heap} MB {method} ({pleg} PLEG) run {which}: {row['phase']} in "
                       f"{row['total_s'] or 0:.2f} s, blackout {row['blackout_s']} "
                       f"(a client saw {row['client_blackout_s'] or 0:.2f} s)")  # fmt: skip
                pod = row.get("pod", pod)
        if engine:
            manage.stop(cluster.lab, workload)
    install.remove_example(cluster, NS)
    cluster.set_pleg("generic", report)
    result = {**summarize(rows), "pod_shape": pod_shape}
    (out_dir / "k8s.json").write_text(json.dumps(result, indent=2))
    return result


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r for r in rows if not r.get("warmup")]
    table = []
    plegs = [p for p in kubelet.PLEGS if any(r.get("pleg", "generic") == p for r in measured)]
    for heap, method, pleg in ((h, m, p) for h in sorted({r["heap_mb"] for r in measured}) for m in METHODS
                               for p in plegs):  # fmt: skip
        sel = [r for r in measured
               if r["heap_mb"] == heap and r["method"] == method and r.get("pleg", "generic") == pleg]  # fmt: skip
        if not sel:
            continue
        done = [r for r in sel if r["phase"] == "Completed"]
        phases = {p: stats.describe([r["phase_s"][p] for r in done if p in r["phase_s"]]).get("median")
                  for p in PHASES}  # fmt: skip
        table.append({
            "heap_mb": heap, "method": method, "pleg": pleg, "n": len(sel), "completed": len(done),
            "blackout_s": stats.describe([r["blackout_s"] or 0.0 for r in done]),
            "client_blackout_s": stats.describe([r.get("client_blackout_s") or 0.0 for r in done]),
            "client_went_back": sum(1 for r in done if r.get("client_went_back")),
            "drift_s": stats.describe([r["drift_s"] or 0.0 for r in done]),
            "total_s": stats.describe([r["total_s"] for r in done]),
            "phase_median_s": {p: v for p, v in phases.items() if v is not None},
            "state_kept": sum(1 for r in done if r.get("sha256_equal") and r.get("same_process")),
            "bytes_median": stats.describe([float(r["bytes"] or 0) for r in done]).get("median"),
            "failures": [r["message"] for r in sel if r["phase"] != "Completed"][:3],
            "cutover_failed_probes": sum(r.get("cutover_failed_probes") or 0 for r in done),
        })  # fmt: skip
    return {"created": time.time(), "rows": len(measured), "table": table,
            "targets": k8s_targets.ratios(table, rows)}  # fmt: skip


def markdown(k8s: dict[str, Any]) -> list[str]:
    """The report's section: the Kubernetes path, per heap and method, beside the study."""
    lines = [
        "## The Kubernetes path (upstream Kubernetes v1.37, containerd 2.1, CRIU)",
        "",
        "Blackout (record): the time the Service selected no ready pod (the operator's cutover record; "
        "decoupled keeps serving from the source, so 0, with the source's post-checkpoint drift beside it). "
        "Client: the longest run of failed probes a client on the LAN saw (50 Hz through the NodePort, a new "
        "connection per probe, 1 s timeout); went back: runs in which it read an older state. "
        "The study: decoupled 1.064 s at the cutover (a prober through Cilium), stop-copy 1.878 s, "
        "cold 1.019 s, all 256 MB.",
        "",
        f"The example pod: {SHAPE_TEXT[k8s.get('pod_shape', 'sidecar')]}.",
        "",
        "| heap MB | method | PLEG | n | done | state kept | blackout (record) median s | client blackout median s | "
        "went back | drift median s | total median s | " + " | ".join(PHASES) + " |",
        "|" + "---|" * (11 + len(PHASES)),
    ]
    for t in k8s["table"]:
        ph = [f"{t['phase_median_s'][p]:.3f}" if p in t["phase_median_s"] else "" for p in PHASES]
        lines.append(
            f"| {t['heap_mb']} | {t['method']} | {t.get('pleg', 'generic')} | {t['n']} | {t['completed']} | "
            f"{t['state_kept']} | "
            f"{_m(t['blackout_s'])} | {_m(t.get('client_blackout_s') or {})} | {t.get('client_went_back', '')} | "
            f"{_m(t['drift_s'])} | {_m(t['total_s'])} | " + " | ".join(ph) + " |"
        )
    lines.append("")
    return lines + k8s_targets.markdown(k8s.get("targets") or [])


def _m(d: dict[str, Any]) -> str:
    return f"{d['median']:.3f}" if d.get("n") else ""


def draw(k8s: dict[str, Any], out_dir: Path) -> Path | None:
    """Stacked bars of the median phase times per heap and method."""
    if not k8s["table"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{t['heap_mb']} MB\n{t['method']}" for t in k8s["table"]]
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.1), 4.5))
    bottom = [0.0] * len(labels)
    for p in PHASES:
        vals = [t["phase_median_s"].get(p, 0.0) for t in k8s["table"]]
        ax.bar(labels, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("median seconds")
    ax.set_title("Kubernetes path: where a migration's time goes")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    path = out_dir / "k8s-phases.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
