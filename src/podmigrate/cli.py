"""The command line: each command parses its options and makes one library call.

Errors print as ``ERROR: message`` plus a hint and the details that help (CRIU log lines, a
failing command's output); ``-v`` adds the traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from podmigrate.errors import PodmigrateError

# Tables stay readable when piped to a file or a CI log (rich assumes 80 columns there).
out = Console() if sys.stdout.isatty() else Console(width=160)
err = Console(stderr=True)


@contextmanager
def status(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner on a terminal, plain lines otherwise; yields a function that reports a step."""
    if err.is_terminal:
        with err.status(title) as st:

            def report(msg: str) -> None:
                err.print(f"  [dim]•[/dim] {msg}")
                st.update(f"{title}: {msg}")

            yield report
    else:
        err.print(title)
        yield lambda msg: err.print(f"  • {msg}")


def fail(e: Exception, verbose: bool) -> None:
    err.print(f"[bold red]ERROR:[/bold red] {e}", highlight=False, markup=True)
    if isinstance(e, PodmigrateError) and e.details:
        for k, v in e.details.items():
            if k in ("traceback", "record") and not verbose:
                continue
            if isinstance(v, list):
                if v:
                    err.print(f"  {k}:")
                    for line in v:
                        err.print(f"    {line}", highlight=False, markup=False)
            elif v not in (None, "", {}):
                err.print(f"  {k}: {v}", highlight=False, markup=False)
    if verbose:
        traceback.print_exception(e)
    sys.exit(1)


class Cli(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PodmigrateError as e:
            fail(e, bool(ctx.obj and ctx.obj.get("verbose")))


def emit(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        render(data)


@click.group(cls=Cli)
@click.option(
    "--lab", "lab_name", default="default", envvar="PODMIGRATE_LAB", show_default=True, help="Which lab to act on."
)
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@click.pass_context
def main(ctx: click.Context, lab_name: str, verbose: bool) -> None:
    """podmigrate: live-migrate stateful containers with CRIU, and measure what it costs."""
    ctx.obj = {"lab": lab_name, "verbose": verbose}


def get_lab(ctx: click.Context) -> Any:
    from podmigrate.lab.cluster import Lab

    return Lab(ctx.obj["lab"])


# ---------------------------------------------------------------------------------------- lab
@main.group()
def lab() -> None:
    """Create, inspect, enter and remove the local lab."""


@lab.command("up")
@click.option("--nodes", default=2, show_default=True, type=click.IntRange(1, 20), help="Number of nodes.")
@click.option(
    "--router",
    type=click.Choice(["route", "nft"]),
    help="How service addresses are switched: a /32 route (the default), or an nftables map that can "
    "drain open connections. Given on a running lab, it switches without a gap.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def lab_up(ctx: click.Context, nodes: int, router: str | None, as_json: bool) -> None:
    """Build the node image if needed and start the lab (idempotent)."""
    the_lab = get_lab(ctx)
    with status(f"Lab {the_lab.name!r} up") as report:
        st = the_lab.up(nodes=nodes, report=report, router=router)
    emit(st, as_json, render_status)


@lab.command("router")
@click.argument("name", required=False, type=click.Choice(["route", "nft"]))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def lab_router(ctx: click.Context, name: str | None, as_json: bool) -> None:
    """Show the LAN's router and the service addresses it holds, or switch to NAME."""
    the_lab = get_lab(ctx)
    res = the_lab.set_router(name) if name else the_lab.router()

    def render(r: dict[str, Any]) -> None:
        t = Table("service address", "node", "draining")
        for s in r["services"]:
            t.add_row(str(s["dst"]), str(s["via"]), "yes" if s.get("draining") else "-")
        out.print(f"router [bold]{r['name']}[/bold]")
        out.print(t)

    emit(res, as_json, render)


@lab.command("down")
@click.pass_context
def lab_down(ctx: click.Context) -> None:
    """Stop the lab and remove everything it created."""
    the_lab = get_lab(ctx)
    with status(f"Lab {the_lab.name!r} down") as report:
        the_lab.down(report=report)
    err.print(f"lab {the_lab.name!r} is down")


@lab.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def lab_status(ctx: click.Context, as_json: bool) -> None:
    """Show nodes, agents, addresses and containers."""
    st = get_lab(ctx).status()
    emit(st, as_json, render_status)
    if not st["up"]:
        sys.exit(3)


def render_status(st: dict[str, Any]) -> None:
    if not st["up"]:
        out.print(f"lab {st['name']!r} is not up")
        return
    out.print(
        f"lab [bold]{st['name']}[/bold] up (pid {st['pid']}), registry {st['registry']}, "
        f"LAN agent {st['lan'].get('agent')}, router {st['lan'].get('router', '-')}"
    )
    t = Table("node", "address", "pods range", "agent", "CRIU", "containers")
    for n in st["nodes"]:
        a = n["agent"]
        ctrs = ", ".join(f"{c['name']}({c['state']} {' '.join(c['ips'])})" for c in n.get("containers", []))
        t.add_row(
            n["name"],
            n["ip"],
            n["range"],
            "up" if "criu" in a else str(a.get("error")),
            str(a.get("criu", "-")),
            ctrs or "-",
        )
    out.print(t)


@lab.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("target")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def lab_exec(ctx: click.Context, target: str, argv: tuple[str, ...]) -> None:
    """Run a command on a node (node-a, ...), on the LAN (lan) or in the lab namespace (lab)."""
    sys.exit(get_lab(ctx).exec_interactive(target, list(argv)))


# ---------------------------------------------------------------------------------------- workload
@main.group()
def workload() -> None:
    """Start, read and stop the stateful test workload (stream-server)."""


@workload.command("start")
@click.argument("kind", type=click.Choice(["heap"]))
@click.option("--node", required=True, help="Node to start it on (node-a, node-b, ...).")
@click.option("--name", required=True, help="Container name (the pod name with --sidecar).")
@click.option("--heap-mb", type=int, default=256, show_default=True, help="Heap size in MB.")
@click.option("--seed", type=int, default=1234, show_default=True, help="Seed of the heap's contents.")
@click.option("--sidecar", is_flag=True, help="Run as a pod with a loopback-forwarding sidecar.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def workload_start(
    ctx: click.Context, kind: str, node: str, name: str, heap_mb: int, seed: int, sidecar: bool, as_json: bool
) -> None:
    """Start a stream-server holding a pseudo-random heap of HEAP_MB megabytes."""
    from podmigrate.workload import manage

    with status(f"Starting {name} on {node}"):
        st = manage.start(get_lab(ctx), name, node, heap_mb, sidecar=sidecar, seed=seed)
    emit(st, as_json, render_state)


@workload.command("state")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def workload_state(ctx: click.Context, name: str, as_json: bool) -> None:
    """Read the workload's state through its service address, from the LAN."""
    from podmigrate.workload import manage

    emit(manage.state(get_lab(ctx), name), as_json, render_state)


@workload.command("stop")
@click.argument("name")
@click.pass_context
def workload_stop(ctx: click.Context, name: str) -> None:
    """Remove the workload (and any stopped copies) and its route."""
    from podmigrate.workload import manage

    res = manage.stop(get_lab(ctx), name)
    err.print(f"removed {', '.join(res['removed'])}")


def render_state(st: dict[str, Any]) -> None:
    out.print(
        f"[bold]{st['name']}[/bold] on {st['node']} at {st['service']}: counter {st['counter']}, "
        f"heap {st['heap_mb']} MB sha256 {st['sha256'][:16]}…, pid {st['pid']}"
    )


# ---------------------------------------------------------------------------------------- migrate
@main.command()
@click.argument("name")
@click.option("--to", "target", required=True, help="Target node.")
@click.option(
    "--mode",
    default="stop-copy",
    show_default=True,
    type=click.Choice(["stop-copy", "decoupled", "lazy", "cold"]),
    help="stop-copy: freeze, move, restore (no drift); decoupled: the source serves until its copy is up "
    "(drift); lazy: post-copy, the copy runs at once and pulls its memory on demand; cold: a fresh start from "
    "the image (state lost: the baseline).",
)
@click.option(
    "--transport",
    default="registry",
    show_default=True,
    type=click.Choice(["registry", "stream", "archive"]),
    help="registry: an OCI checkpoint image through the lab registry; stream: memory pages into the target's "
    "CRIU page server during the dump, the rest agent to agent; archive: podman's export/import with a copy.",
)
@click.option(
    "--compression",
    default="none",
    show_default=True,
    type=click.Choice(["none", "gzip", "zstd"]),
    help="Registry transport: compress the checkpoint layer (gzip single-threaded, zstd multi-threaded).",
)
@click.option("--no-tcp-established", is_flag=True, help="Do not carry established TCP connections.")
@click.option(
    "--only-container",
    "only",
    multiple=True,
    help="Pods: checkpoint only this member (repeatable); the others start fresh on the target, which "
    "severs their loopback connections with it (the study's single-container finding). Default: all.",
)
@click.option(
    "--drain-timeout",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0, 600),
    help="Decoupled, on a lab with the nft router: how long connections open at the cutover may finish on "
    "the source before it is retired.",
)
@click.option(
    "--probe",
    help="How to probe the service: http:PORT/PATH or tcp:PORT (default: from the container's podmigrate.* labels).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the full migration record as JSON.")
@click.pass_context
def migrate(
    ctx: click.Context,
    name: str,
    target: str,
    mode: str,
    transport: str,
    compression: str,
    no_tcp_established: bool,
    only: tuple[str, ...],
    drain_timeout: float,
    probe: str | None,
    as_json: bool,
) -> None:
    """Move running container NAME to node TARGET with its memory, address and connections."""
    from podmigrate.engine.controller import Plan
    from podmigrate.engine.controller import migrate as run_migration

    plan = Plan(
        workload=name,
        target=target,
        mode=mode,
        transport=transport,
        compression=compression,
        tcp_established=not no_tcp_established,
        only=only,
        probe=probe,
        drain_timeout=drain_timeout,
    )
    with status(f"Migrating {name} to {target} ({mode}, {transport})") as report:
        rec = run_migration(get_lab(ctx), plan, report)
    emit(rec, as_json, render_migration)


def render_migration(rec: dict[str, Any]) -> None:
    t = Table(
        "phase",
        "seconds",
        title=f"migration {rec['id']}: {rec['workload']} {rec['source']} → {rec['target']} ({rec['status']})",
    )
    for p, s in rec["phase_s"].items():
        t.add_row(p, f"{s:.3f}")
    out.print(t)
    line = f"blackout {rec['blackout_s']:.3f} s ({rec['blackout_method']})"
    if rec.get("blackout_cutover_s") is not None:
        line += f", at the cutover {rec['blackout_cutover_s']:.3f} s"
    if rec.get("drift"):
        line += f"; drift {rec['drift']['counter']} ticks ({rec['drift']['since_checkpoint_s']:.2f} s since checkpoint)"
    out.print(line + f"; moved {rec['bytes_moved'] / 2**20:.1f} MiB; state {rec.get('state', 'not checked')}")
    cut = rec.get("cutover") or {}
    if cut:
        drained = "".join(
            f"; {d['addr']} drained in {d['drained_s']:.3f} s" + (f" ({d['open']} cut off)" if d["forced"] else "")
            for d in cut.get("drain", [])
        )
        out.print(f"cutover: {cut.get('router')} switch {cut.get('switch_s', 0) * 1000:.1f} ms{drained}")
    for w in rec.get("warnings") or []:
        err.print(f"[yellow]warning:[/] {w}")
    if rec.get("checks"):
        b, a = rec["state_before"], rec["state_after"]
        out.print(
            f"heap sha256 before {b['sha256'][:16]}… after {a['sha256'][:16]}… "
            f"counter {b['counter']} → {a['counter']}  checks: "
            + ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in rec["checks"].items())
        )


# ---------------------------------------------------------------------------------------- demo
@main.command()
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
@click.pass_context
def demo(ctx: click.Context, heap_mb: int, suite_runs: int, out_dir: str | None, as_json: bool) -> None:
    """Lab up, start a stateful workload, migrate it to node-b and back, print the evidence."""
    import time
    from pathlib import Path

    from podmigrate import demo as demo_mod

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


# ---------------------------------------------------------------------------------------- history, gc
@main.command()
@click.option("--limit", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def history(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List past migrations, newest first."""
    from podmigrate.engine.controller import store_for

    the_lab = get_lab(ctx)
    the_lab.require_up()
    recs = store_for(the_lab).list(limit=limit)
    if as_json:
        click.echo(json.dumps(recs, indent=2, default=str))
        return
    t = Table("id", "workload", "route", "mode", "transport", "status", "blackout s", "drift", "MiB moved")
    for r in recs:
        t.add_row(
            r["id"],
            r["workload"],
            f"{r.get('source')} → {r['target']}",
            r["mode"],
            r["transport"],
            r["status"],
            f"{r['blackout_s']:.3f}" if r.get("blackout_s") is not None else "-",
            str((r.get("drift") or {}).get("counter", "-")),
            f"{r.get('bytes_moved', 0) / 2**20:.0f}",
        )
    out.print(t)


@main.command()
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def gc(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Remove what failed or interrupted migrations left: archives, images, stopped copies, routes."""
    from podmigrate.engine import gc as gc_mod

    the_lab = get_lab(ctx)
    the_lab.require_up()
    with status("Collecting leftovers") as report:
        found = gc_mod.collect(the_lab, dry_run=dry_run, report=report)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    for kind, items in found.items():
        for item in items:
            out.print(f"{'would remove' if dry_run else 'removed'} {kind[:-1]} {item}")
    out.print(gc_mod.summary(found))


# ---------------------------------------------------------------------------------------- bench
@main.group()
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
@click.pass_context
def bench_engine(
    ctx: click.Context, heaps: str, runs: int, methods: str | None, out_dir: str | None, warm_memory_gb: float | None
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


@main.command("report")
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


@main.group("k8s")
def k8s_group() -> None:
    """Kubernetes: the CRD manifest, the operator and the node agent (see deploy/kubernetes/)."""


@k8s_group.command("crd")
def k8s_crd() -> None:
    """Print the PodLiveMigration CRD manifest (deploy/kubernetes/base/crd.yaml is this output)."""
    from podmigrate.k8s import manifests

    click.echo(manifests.crd_yaml(), nl=False)


@k8s_group.command("operator", context_settings={"ignore_unknown_options": True})
@click.argument("kopf_args", nargs=-1, type=click.UNPROCESSED)
def k8s_operator(kopf_args: tuple[str, ...]) -> None:
    """Run the operator: `kopf run --standalone --all-namespaces -m podmigrate.k8s.operator [KOPF_ARGS]`."""
    import os
    import sys

    args = ["kopf", "run", "--standalone", "--all-namespaces", "-m", "podmigrate.k8s.operator", *kopf_args]
    os.execv(sys.executable, [sys.executable, "-m", *args])


@k8s_group.command("agent", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("agent_args", nargs=-1, type=click.UNPROCESSED)
def k8s_agent(agent_args: tuple[str, ...]) -> None:
    """Run the node agent (the DaemonSet's process); `podmigrate k8s agent --help` lists its options."""
    from podmigrate.k8s import agent

    agent.main(list(agent_args))
