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
    "default: what the runs touch (3x the largest heap + 1 GiB), leaving 4 GiB free; 0: skip.",
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
        "heap MB",
        "method",
        "n",
        "blackout s",
        "at cutover s",
        "drift",
        "CRIU frozen s",
        "phases (median s)",
        "MB/s",
        "state",
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
            str(r.get("throughput_mb_s") or "-"),
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
