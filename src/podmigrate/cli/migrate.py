"""``podmigrate migrate``, ``history`` and ``gc``: one migration (``engine.controller``), the record
of past ones, and what failed ones left (``engine.gc``); ``render_migration`` prints a record.
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from podmigrate.cli.lab import get_cluster, get_lab
from podmigrate.cli.output import emit, err, out, status
from podmigrate.engine.plans import DEFAULT_TRANSPORT


@click.command()
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
    default=DEFAULT_TRANSPORT,
    show_default=True,
    type=click.Choice(["registry", "stream", "archive"]),
    help="stream (the fastest with zero drift): memory pages into the target's CRIU page server during the "
    "dump, the rest agent to agent; registry: an OCI checkpoint image through the lab registry (what a "
    "cluster does, and it leaves the checkpoint restorable later); archive: podman's export/import with a "
    "copy. Pods always move as archives.",
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
@click.option(
    "--security",
    default="on",
    show_default=True,
    type=click.Choice(["on", "off"]),
    help="off: this migration's checkpoint travels unsealed and its pages without TLS (agents keep mutual "
    "TLS); only to measure what on costs. Other migrations are not affected.",
)
@click.option(
    "--old-paths",
    default="",
    help="Measuring only: take engine.paths' old path for these changes (comma-separated, or all) in this "
    "migration; the record lists the ones it took.",
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
    security: str,
    old_paths: str,
    as_json: bool,
) -> None:
    """Move running container NAME to node TARGET with its memory, address and connections."""
    from podmigrate.engine import paths
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
        security=security,
        old_paths=paths.parse(old_paths),
    )
    with status(f"Migrating {name} to {target} ({mode}, {transport})") as report:
        rec = run_migration(get_cluster(ctx), plan, report)
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
    if rec.get("answers_at"):
        out.print(f"[bold]{rec['workload']} now answers at {', '.join(rec['answers_at'])}[/] (its address changed)")
    if rec.get("tcp"):
        out.print(f"tcp: {rec['tcp']}")
    if rec.get("security"):
        out.print("security: " + describe_security(rec["security"]))
    if rec.get("old_paths"):
        out.print(f"[yellow]old paths taken (measuring):[/] {', '.join(rec['old_paths'])}")
    for w in rec.get("warnings") or []:
        err.print(f"[yellow]warning:[/] {w}")
    if rec.get("checks"):
        b, a = rec["state_before"], rec["state_after"]
        out.print(
            f"heap sha256 before {b['sha256'][:16]}… after {a['sha256'][:16]}… "
            f"counter {b['counter']} → {a['counter']}  checks: "
            + ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in rec["checks"].items())
        )


def describe_security(sec: dict[str, Any]) -> str:
    """What a record's ``security`` says crossed how, in one line (only what it says happened)."""
    parts = []
    if "sealed" in sec:
        parts.append("checkpoint " + ("sealed" if sec["sealed"] else "NOT sealed"))
    if "pages" in sec:
        parts.append(f"pages {sec['pages']}")
    if "agents" in sec:
        parts.append(f"agent to agent {sec['agents']}")
    if "controller" in sec:
        parts.append(f"controller to agents {sec['controller']}")
    return "; ".join(parts) or "nothing crossed between the nodes"


@click.command()
@click.option("--limit", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def history(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List past migrations, newest first."""
    from podmigrate.engine.controller import store_for

    the_lab = get_cluster(ctx)
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


@click.command()
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def gc(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Remove what failed or interrupted migrations left: archives, images, stopped copies, routes."""
    from podmigrate.engine import gc as gc_mod

    the_lab = get_lab(ctx)
    the_lab.require_up()
    from podmigrate.lab import registry_gc

    with status("Collecting leftovers") as report:
        found = gc_mod.collect(the_lab, dry_run=dry_run, report=report)
        if not dry_run:
            report("freeing the registry's unreferenced blobs (the registry pauses)")
            freed = registry_gc.collect(the_lab)
    if as_json:
        click.echo(json.dumps({**found, **({"registry": freed} if not dry_run else {})}, indent=2))
        return
    for kind, items in found.items():
        for item in items:
            out.print(f"{'would remove' if dry_run else 'removed'} {kind[:-1]} {item}")
    out.print(gc_mod.summary(found))
    if not dry_run:
        out.print(f"registry: {(freed['bytes_before'] - freed['bytes_after']) >> 20} MiB of blobs freed")
