"""``podmigrate bench ...``, ``report`` and ``demo``: the benchmarks (``podmigrate.bench``), the report
of a results directory (``bench.report``) and the main job (``podmigrate.demo``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.table import Table

from podmigrate.cli.lab import get_lab
from podmigrate.cli.output import err, out, status
from podmigrate.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])


def on_off(name: str, default: str, help: str) -> Callable[[F], F]:
    """An option that is on, off, or both in turn (``on,off``: a comparison within one run)."""
    choice = click.Choice(["on", "off", "on,off"])
    return click.option(f"--{name}", default=default, show_default=True, type=choice, help=help)


@click.group()
def bench() -> None:
    """Benchmarks: measure, print and save figures."""


@bench.command("engine")
@click.option("--heaps", default="64,256,1024", show_default=True, help="Heap sizes in MB, comma-separated.")
@click.option("--runs", default=3, show_default=True, type=click.IntRange(1, 100), help="Runs per method and heap.")
@click.option("--methods", default=None, help="Comma-separated subset of method labels (default: all).")
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/bench-TIMESTAMP]")
@click.option(
    "--warm-memory-gb",
    type=float,
    default=None,
    help="Touch this much guest memory once before measuring (first touch is slow on VMs); "
    "default: all free memory but 4 GiB; 0: skip.",
)
@on_off("security", "on", "on,off: every run of every method with sealing and CRIU's TLS on and off, interleaved.")
@click.option(
    "--old-paths",
    default="",
    help="Changes of engine.paths (comma-separated, or all): every run with the new path and the old, "
    "interleaved, and their ratio.",
)
@on_off(
    "load",
    "off",
    "A background load beside the migrations (3 mesh services per node, 50 requests/s each); on,off: "
    "every run with and without it, interleaved.",
)
@click.pass_context
def bench_engine(
    ctx: click.Context,
    heaps: str,
    runs: int,
    methods: str | None,
    out_dir: str | None,
    warm_memory_gb: float | None,
    security: str,
    old_paths: str,
    load: str,
) -> None:
    """Every mode and transport at several heap sizes, beside Podman's own two paths."""
    import time
    from pathlib import Path

    from podmigrate.bench import engine

    try:
        sizes = [int(h) for h in heaps.split(",")]
    except ValueError as e:
        raise click.BadParameter(f"not a list of sizes: {heaps!r}", param_hint="--heaps") from e
    if any(h <= 0 for h in sizes):
        raise click.BadParameter("heap sizes must be positive", param_hint="--heaps")
    out_path = Path(out_dir or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    with status("Engine benchmark") as report:
        summary = engine.run(
            get_lab(ctx),
            sizes,
            runs,
            out_path,
            report,
            methods=methods.split(",") if methods else None,
            warm_memory_gib=warm_memory_gb,
            security=tuple(security.split(",")),
            old_paths=tuple(x for x in old_paths.split(",") if x),
            load=tuple(load.split(",")),
        )
    t = Table(
        "heap MB", "method", "n", "blackout s", "at cutover s", "drift", "CRIU frozen s", "phases (median s)", "state"
    )
    for r in summary["table"]:
        t.add_row(
            str(r["heap_mb"]),
            r["method"],
            str(r["n"]),
            str(r["blackout_s"]),
            str(r["blackout_cutover_s"] if r["blackout_cutover_s"] is not None else "-"),
            str(r["drift_counter"] if r["drift_counter"] is not None else "-"),
            str(r["criu_frozen_s"] if r["criu_frozen_s"] is not None else "-"),
            " ".join(f"{k}={v}" for k, v in r["phase_s"].items() if k not in ("validate", "verify", "cleanup")),
            str(r["state"]),
        )
    out.print(t)
    if summary["security_cost"]:
        c = Table("heap MB", "method", "n", "blackout on s", "off s", "on / off", title="what security costs")
        for r in summary["security_cost"]:
            c.add_row(
                str(r["heap_mb"]),
                r["method"],
                str(r["n"]),
                str(r["blackout_on_s"]),
                str(r["blackout_off_s"]),
                str(r["ratio"]),
            )
        out.print(c)
    for pairs, a, b, title in (
        (summary["old_paths"]["new_over_old"], "new", "old", "the new paths against the old"),
        (summary["load"]["on_over_off"], "load on", "off", "with the background load and without"),
    ):
        if pairs:
            c = Table("heap MB", "method", "n", f"blackout {a} s", f"{b} s", "ratio", title=title)
            for r in pairs:
                cells = (r["heap_mb"], r["method"], r["n"], r["blackout_a_s"], r["blackout_b_s"], r["ratio"])
                c.add_row(*(str(x) for x in cells))
            out.print(c)
    steps = Table("heap MB", "method", "blackout s", "where it went (s)", "unaccounted s", title="the median run")
    for r in summary["table"]:
        if st := r.get("blackout_steps"):
            parts = ", ".join(f"{w} {v}" for w, v in sorted(st["steps"].items(), key=lambda x: -x[1])[:5])
            steps.add_row(str(r["heap_mb"]), r["method"], str(st["window_s"]), parts, str(st["unaccounted_s"]))
    if steps.rows:
        out.print(steps)
    if summary["ratios"]:
        rt = Table("ratio (medians of this run)", "value", "target", "holds", title="targets")
        for r in summary["ratios"]:
            what = f"{r['ratio']} · {r['variant']}" if r.get("variant") else r["ratio"]
            rt.add_row(what, str(r["value"]), r["target"], "yes" if r["holds"] else "NO")
        out.print(rt)
    err.print(f"results: {out_path}/ (bench.md, bench.json, rows.json)")


SWEEP_METHODS = (
    "stop-copy/registry,stop-copy/registry+gzip,stop-copy/registry+zstd,stop-copy/stream,decoupled/stream,cold"
)


@bench.command("sweep")
@click.option("--heaps", default="26,64,128,256,512,1024", show_default=True, help="Heap sizes in MB.")
@click.option("--runs", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--methods", default=SWEEP_METHODS, show_default=True)
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/sweep-TIMESTAMP]")
@click.option("--warm-memory-gb", type=float, default=None, help="As for `bench engine`.")
@click.pass_context
def bench_sweep(
    ctx: click.Context, heaps: str, runs: int, methods: str, out_dir: str | None, warm_memory_gb: float | None
) -> None:
    """The study's heap sweep: heap sizes x modes x compression, each migration checked by SHA-256."""
    import time

    ctx.invoke(
        bench_engine,
        heaps=heaps,
        runs=runs,
        methods=methods,
        out_dir=out_dir or f"results/sweep-{time.strftime('%Y%m%d-%H%M%S')}",
        warm_memory_gb=warm_memory_gb,
        security="on",
    )


@bench.command("suite")
@click.option("--runs", default=36, show_default=True, type=click.IntRange(1, 1000), help="Migrations per mode.")
@click.option("--cold", default=20, show_default=True, type=click.IntRange(1, 1000), help="Cold restarts.")
@click.option("--heap-mb", default=64, show_default=True, type=click.IntRange(1, 65536))
@click.option(
    "--groups",
    default="decoupled,stop-copy",
    show_default=True,
    help="Modes to run (decoupled, stop-copy, lazy, stop-copy-registry), comma-separated.",
)
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0, 100), help="Warm-up runs per mode.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(),
    default=None,
    help="[default: results/suite-TIMESTAMP]; an existing directory is resumed.",
)
@click.option("--warm-memory-gb", type=float, default=None, help="As for `bench engine`.")
@click.pass_context
def bench_suite(
    ctx: click.Context,
    runs: int,
    cold: int,
    heap_mb: int,
    groups: str,
    warmup: int,
    out_dir: str | None,
    warm_memory_gb: float | None,
) -> None:
    """N migrations per mode alternating direction, then M cold restarts; then the report."""
    import time
    from pathlib import Path

    from podmigrate.bench import report, suite

    out_path = Path(out_dir or f"results/suite-{time.strftime('%Y%m%d-%H%M%S')}")
    with status("Suite") as rep:
        suite.run(
            get_lab(ctx),
            out_path,
            runs=runs,
            cold=cold,
            heap_mb=heap_mb,
            groups=tuple(g for g in groups.split(",") if g),
            warmup=warmup,
            report=rep,
            warm_memory_gib=warm_memory_gb,
        )
    report.build(out_path)
    err.print(f"results and report: {out_path}/ (report.md, report.html, suite.jsonl)")


@bench.command("soak")
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


@bench.command("evacuate")
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


@bench.command("faults")
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


@bench.command("k8s")
@click.option("--heaps", default="64,1024", show_default=True, help="Heap sizes in MB, comma-separated.")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(1, 1000), help="Runs per method and heap.")
@click.option(
    "--methods",
    default=None,
    help="Comma-separated subset of decoupled/cri, decoupled/runtimeclass, stop-copy/cri, stop-copy/runtimeclass, "
    "cold [default: all].",
)
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0, 100))
@click.option("--lab", "lab_name", default="k8s", show_default=True, help="A lab with containerd nodes (made if down).")
@click.option("--out", "out_dir", type=click.Path(), default=None, help="[default: results/k8s-TIMESTAMP]")
def bench_k8s(heaps: str, runs: int, methods: str | None, warmup: int, lab_name: str, out_dir: str | None) -> None:
    """The Kubernetes path: PodLiveMigrations on real kubelets over containerd, N per heap and method
    (cri and runtimeclass restore), interleaved; then the report with its phase breakdown."""
    import time
    from pathlib import Path

    from podmigrate.bench import k8s, report

    out_path = Path(out_dir or f"results/k8s-{time.strftime('%Y%m%d-%H%M%S')}")
    heap_list = [int(h) for h in heaps.split(",") if h]
    with status("Kubernetes path") as rep:
        chosen = [m for m in methods.split(",") if m] if methods else list(k8s.METHODS)
        result = k8s.run(lab_name, out_path, heap_list, chosen, runs, warmup, rep)
    report.build(out_path)
    t = Table("heap MB", "method", "n", "kept", "blackout s", "drift s", "total s", *k8s.PHASES)
    for row in result["table"]:
        med = [f"{row['phase_median_s'][p]:.3f}" if p in row["phase_median_s"] else "" for p in k8s.PHASES]
        t.add_row(str(row["heap_mb"]), row["method"], str(row["n"]), str(row["state_kept"]),
                  *(f"{row[x]['median']:.3f}" if row[x].get("n") else "" for x in ("blackout_s", "drift_s", "total_s")),
                  *med)  # fmt: skip
    out.print(t)
    err.print(f"results and report: {out_path}/ (report.md, k8s.json, k8s.jsonl, k8s-phases.png)")


@click.command("report")
@click.argument("results_dir", type=click.Path(exists=True, file_okay=False))
def report_cmd(results_dir: str) -> None:
    """Build report.md, report.html and PNG plots from a results directory."""
    from pathlib import Path

    from podmigrate.bench import report

    try:
        report.build(Path(results_dir))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from e
    out.print((Path(results_dir) / "report.md").read_text(), markup=False, highlight=False)


@click.command()
@click.option("--heap-mb", type=int, default=256, show_default=True)
@click.option(
    "--suite-runs",
    type=click.IntRange(0, 100),
    default=3,
    show_default=True,
    help="Runs per mode of the short suite that ends the demo (0: none).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(),
    default=None,
    help="Where to write results [default: results/demo-TIMESTAMP].",
)
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--kubernetes",
    is_flag=True,
    help="The Kubernetes path instead: containerd nodes (lab 'k8s'), kubelets, agents, the operator, the example "
    "pod moved node-a -> node-b (CRI restore) and back (RuntimeClass restore).",
)
@click.pass_context
def demo(
    ctx: click.Context, heap_mb: int, suite_runs: int, out_dir: str | None, as_json: bool, kubernetes: bool
) -> None:
    """Lab up, start a stateful workload, migrate it to node-b and back, print the evidence."""
    import time
    from pathlib import Path

    from podmigrate import demo as demo_mod

    if kubernetes:
        out_path = Path(out_dir or f"results/demo-k8s-{time.strftime('%Y%m%d-%H%M%S')}")
        with status("podmigrate demo --kubernetes") as report:
            summary = demo_mod.run_kubernetes("k8s", heap_mb, out_path, report=report)
        if as_json:
            click.echo(json.dumps(summary, indent=2))
        else:
            render_k8s_demo(summary)
            err.print(f"results: {out_path}/summary.json")
        sys.exit(0 if summary["state_kept"] else 2)
    out_path = Path(out_dir or f"results/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    with status("podmigrate demo") as report:
        summary = demo_mod.run(get_lab(ctx), heap_mb, out_path, report=report, suite_runs=suite_runs)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        render_demo(summary)
        if summary.get("suite"):
            out.print(
                "short suite, median blackout (s): "
                + ", ".join(f"{g} {v}" for g, v in summary["suite"].items())
                + f"; report: {summary['suite_report']} (and report.html beside it)"
            )
        err.print(f"results: {out_path}/ (summary.md, summary.json, one JSON record per migration)")
    if not (summary["digests_identical"] and summary["counter_never_backwards"]):
        sys.exit(2)


def render_k8s_demo(s: dict[str, Any]) -> None:
    phases = ("validate", "checkpoint", "package", "restore", "cutover", "cleanup")
    t = Table("PodLiveMigration", "phase", "restore path", "blackout s", "drift s", *(f"{p} s" for p in phases),
              "MiB", title=f"podmigrate demo --kubernetes: {s['heap_mb']} MB heap, on containerd")  # fmt: skip
    for m in s["migrations"]:
        t.add_row(f"{m['name']} ({m['from']} -> {m['to']})", str(m["phase"]), str(m["restore_path"]),
                  str(m["blackout_s"]), str(m["drift_s"]), *(str(m["phase_s"].get(p, "")) for p in phases),
                  f"{(m['bytes'] or 0) / 2**20:.0f}")  # fmt: skip
    out.print(t)
    out.print(f"heap SHA-256 {s['sha256'][:16]}... and process start time kept at every step: {s['state_kept']}")


def render_demo(s: dict[str, Any]) -> None:
    phases = list(s["migrations"][0]["phase_s"])
    t = Table(
        "migration",
        "blackout s",
        *phases,
        "MiB moved",
        title=f"podmigrate demo: {s['heap_mb']} MB heap ({s['machine'].get('criu')} CRIU, "
        f"{s['machine'].get('cores')} cores)",
    )
    for m in s["migrations"]:
        t.add_row(
            f"{m['source']} → {m['target']}",
            f"{m['blackout_s']:.3f}",
            *(f"{m['phase_s'][p]:.3f}" for p in phases),
            f"{m['bytes_moved'] / 2**20:.0f}",
        )
    out.print(t)
    ok = "[green]yes[/green]", "[red]NO[/red]"
    out.print(f"heap sha256 {s['sha256']}: identical at every step: {ok[0] if s['digests_identical'] else ok[1]}")
    out.print(f"counter readings {s['counters']}: never backwards: {ok[0] if s['counter_never_backwards'] else ok[1]}")
