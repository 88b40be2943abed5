"""``podmigrate bench soak``, ``evacuate``, ``faults`` and ``k8s``: the benchmarks of many migrations
at once, of whole nodes, of failures and of the Kubernetes path (``cli.bench`` has the group, the
engine, sweep and suite benchmarks; ``cli/__init__`` adds these to it).
"""

from __future__ import annotations

import sys

import click
from rich.table import Table

from podmigrate.cli.lab import get_lab
from podmigrate.cli.output import err, out, status
from podmigrate.errors import UsageError


@click.command("soak")
@click.option("--migrations", default=200, show_default=True, type=click.IntRange(1, 100000))
@click.option("--workloads", default=3, show_default=True, type=click.IntRange(1, 20), help="Migrating at once.")
@click.option("--heap-mb", default=32, show_default=True, type=click.IntRange(1, 65536))
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/soak-TIMESTAMP]")
@click.pass_context
def bench_soak(ctx: click.Context, migrations: int, workloads: int, heap_mb: int, out_dir: str | None) -> None:
    """N migrations in a row, several workloads at once, every mode and transport; leftovers and the
    agents' memory growth at the end."""
    import time
    from pathlib import Path

    from podmigrate.bench import soak

    out_path = Path(out_dir or f"results/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    with status("Soak") as rep:
        r = soak.run(get_lab(ctx), out_path, migrations, workloads, heap_mb, rep)
    t = Table("migrations", "at once", "ok", "state kept", "state lost", "cold fresh", "leftovers", "agent RSS growth")
    left = sum(len(v) for v in r["leftovers"].values())
    growth = ", ".join(f"{n} {(r['agent_rss_bytes']['after'][n] - b) >> 10} KiB"
                       for n, b in r["agent_rss_bytes"]["before"].items())  # fmt: skip
    t.add_row(str(r["migrations"]), str(r["workloads"]), str(r["ok"]), str(r["state_kept"]), str(r["state_lost"]),
              str(r["cold_fresh"]), str(left), growth)  # fmt: skip
    out.print(t)
    for f in r["failed"][:10]:
        err.print(f"failed: {f['workload']} {f['mode']}/{f['transport']}: {f['error'][:200]}")
    err.print(f"results: {out_path}/ (soak.json, soak.jsonl)")
    if r["failed"] or r["state_lost"] or left:
        sys.exit(2)


@click.command("evacuate")
@click.option("--workloads", default="4x256,1x1024,pod64", show_default=True,
              help="The node's workloads: COUNTxMB containers, podMB a pod with a sidecar.")  # fmt: skip
@click.option("--runs", default=2, show_default=True, type=click.IntRange(1, 100), help="Per variant.")
@click.option("--deadline", default=120.0, show_default=True, type=click.FloatRange(1, 3600))
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/evacuate-TIMESTAMP]")
@click.option("--warm-memory-gb", type=float, default=None, help="As for `bench engine`.")
@click.pass_context
def bench_evacuate(
    ctx: click.Context, workloads: str, runs: int, deadline: float, out_dir: str | None, warm_memory_gb: float | None
) -> None:
    """A node of several workloads evacuated N times, as planned and one at a time, alternating
    direction: time to empty against the 120/30/15 s deadlines, blackouts, every heap checked."""
    import time
    from pathlib import Path

    from podmigrate.bench import evacuate as bench_ev

    out_path = Path(out_dir or f"results/evacuate-{time.strftime('%Y%m%d-%H%M%S')}")
    with status("Evacuation benchmark") as rep:
        s = bench_ev.run(get_lab(ctx), out_path, workloads, runs, deadline, rep, warm_memory_gb)
    out.print(bench_ev.markdown(s))
    err.print(f"results: {out_path}/ (evacuate.json, evacuate.md, evacuations.jsonl)")


@click.command("faults")
@click.option("--heap-mb", default=16, show_default=True, type=click.IntRange(1, 65536))
@click.option("--only", default=None, help="Comma-separated faults to run [default: all]: sigterm, controller-killed, "
              "target-agent-killed, source-agent-killed, link-cut, disk-full, registry-down, tampered.")  # fmt: skip
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/faults-TIMESTAMP]")
@click.pass_context
def bench_faults(ctx: click.Context, heap_mb: int, only: str | None, out_dir: str | None) -> None:
    """The fault matrix: each fault point x mode x transport injected for real; where the workload
    serves after each, with what heap, and what was left behind."""
    import time
    from pathlib import Path

    from podmigrate.bench import faults

    known = {c.fault for c in faults.matrix()}
    chosen = [f for f in only.split(",") if f] if only else None
    if chosen and (unknown := set(chosen) - known):
        raise UsageError(
            f"unknown fault(s): {', '.join(sorted(unknown))}", hint=f"choose from: {', '.join(sorted(known))}"
        )
    out_path = Path(out_dir or f"results/faults-{time.strftime('%Y%m%d-%H%M%S')}")
    with status("Fault matrix") as rep:
        r = faults.run(get_lab(ctx), out_path, heap_mb, chosen, rep)
    t = Table("fault", "after", "mode/transport", "outcome", "serves on", "state kept", "left behind", "verdict")
    for row in r["rows"]:
        kept = {None: "n/a (cold)", True: "yes", False: "NO"}[row.get("state_kept")] if row.get("serving") else "-"
        t.add_row(row["fault"], row["point"], f"{row['mode']}/{row['transport']}", row["outcome"],
                  ",".join(row["running_on"]) or "nowhere", kept, str(sum(len(v) for v in row["leftovers"].values())),
                  row["verdict"])  # fmt: skip
    out.print(t)
    err.print(f"{r['cells']} cells: {r['ok']} ok, {r['lost']} lost, {r['twice']} running twice, "
              f"{r['leftovers']} with leftovers; results: {out_path}/ (faults.json, faults.jsonl)")  # fmt: skip
    if r["ok"] != r["cells"]:
        sys.exit(2)


@click.command("k8s")
@click.option("--heaps", default="64,1024", show_default=True, help="Heap sizes in MB, comma-separated.")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1, 1000), help="Runs per method and heap.")
@click.option(
    "--methods",
    default=None,
    help="Comma-separated subset of decoupled/cri, decoupled/runtimeclass, stop-copy/cri, stop-copy/runtimeclass, "
    "cold, and the lab engine's same modes on the same nodes: 'engine stop-copy/stream', 'engine lazy', "
    "'engine cold' [default: all].",
)
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0, 100))
@click.option(
    "--pleg",
    default="generic",
    show_default=True,
    help="The kubelets' PLEG per round, comma-separated and interleaved: generic (a relist every second), "
    "evented (CRI events).",
)
@click.option(
    "--pod",
    "pod_shape",
    type=click.Choice(["sidecar", "single"]),
    default="sidecar",
    show_default=True,
    help="The example pod: its server behind a sidecar (the study's shape) or the server alone (one "
    "container, like the lab engine's workload: the targets' ratios like for like).",
)
@click.option("--lab", "lab_name", default="k8s", show_default=True, help="A lab with containerd nodes (made if down).")
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/k8s-TIMESTAMP]")
def bench_k8s(
    heaps: str,
    runs: int,
    methods: str | None,
    warmup: int,
    pleg: str,
    pod_shape: str,
    lab_name: str,
    out_dir: str | None,
) -> None:
    """The Kubernetes path: PodLiveMigrations on upstream Kubernetes in the lab (made if down), N per
    heap and method (cri and runtimeclass restore), interleaved, each probed from the LAN at 50 Hz;
    then the report with its phase breakdown."""
    import time
    from pathlib import Path

    from podmigrate.bench import k8s, report

    out_path = Path(out_dir or f"results/k8s-{time.strftime('%Y%m%d-%H%M%S')}")
    heap_list = [int(h) for h in heaps.split(",") if h]
    with status("Kubernetes path") as rep:
        chosen = [m for m in methods.split(",") if m] if methods else list(k8s.METHODS)
        plegs = tuple(p for p in pleg.split(",") if p)
        result = k8s.run(lab_name, out_path, heap_list, chosen, runs, warmup, rep, plegs, pod_shape)
    report.build(out_path)
    t = Table("heap MB", "method", "PLEG", "n", "kept", "blackout s", "client s", "drift s", "total s", *k8s.PHASES)
    for row in result["table"]:
        med = [f"{row['phase_median_s'][p]:.3f}" if p in row["phase_median_s"] else "" for p in k8s.PHASES]
        t.add_row(str(row["heap_mb"]), row["method"], row.get("pleg", "generic"), str(row["n"]), str(row["state_kept"]),
                  *(f"{row[x]['median']:.3f}" if row[x].get("n") else ""
                    for x in ("blackout_s", "client_blackout_s", "drift_s", "total_s")),
                  *med)  # fmt: skip
    out.print(t)
    targets = Table("target", "heap MB", "ratio", "limit", "holds")
    for g in result["targets"]:
        got = (f"{g['ratio']:.2f}" if g.get("ratio") is not None else "; ".join(g["missing"])) if "ratio" in g \
            else f"{g['runs_with_failed_probes']} of {g['runs']} runs failed a probe at the cutover"  # fmt: skip
        targets.add_row(
            g["target"], str(g["heap_mb"] or "all"), got, str(g.get("limit", "")), "yes" if g["holds"] else "NO"
        )
    out.print(targets)
    err.print(f"results and report: {out_path}/ (report.md, k8s.json, k8s.jsonl, k8s-phases.png)")
