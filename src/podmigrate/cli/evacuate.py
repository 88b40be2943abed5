"""``podmigrate evacuate``: empty a node before a deadline (``engine.evacuate``), with a live table per
workload while it runs and the end table (or the plan, ``--dry-run``); ``lab cordon``/``uncordon``.
"""

from __future__ import annotations

from typing import Any

import click
from rich.live import Live
from rich.table import Table

from podmigrate.cli.lab import get_lab, lab
from podmigrate.cli.output import emit, err, out, status

GB = 1 << 30


def _nodes(value: str | None) -> list[str] | None:
    return [n.strip() for n in value.split(",") if n.strip()] if value else None


@click.command()
@click.argument("node")
@click.option(
    "--deadline",
    default=120.0,
    show_default=True,
    type=click.FloatRange(1, 3600),
    help="Seconds until the node is gone (AWS Spot: 120, GCP and Azure: 30, GKE: as little as 15).",
)
@click.option("--to", "to", help="Target nodes, comma-separated (default: every other node not cordoned).")
@click.option(
    "--parallel",
    type=click.IntRange(1, 8),
    help="Migrations at once (default: the plan picks from what past evacuations measured).",
)
@click.option("--dry-run", is_flag=True, help="Print the plan with its predicted times; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the evacuation's record (or plan) as JSON.")
@click.pass_context
def evacuate(
    ctx: click.Context, node: str, deadline: float, to: str | None, parallel: int | None, dry_run: bool, as_json: bool
) -> None:
    """Move every workload off NODE before DEADLINE seconds, and cordon it."""
    from podmigrate.engine.evacuate import Evacuation
    from podmigrate.engine.evacuate import dry_run as plan_only

    the_lab = get_lab(ctx)
    the_lab.require_up()
    if dry_run:
        with status(f"Planning the evacuation of {node}") as report:
            data = plan_only(Evacuation(the_lab, node, deadline, _nodes(to), parallel, report))
        emit(data, as_json, render_plan)
        return
    rec = run(the_lab, node, deadline, _nodes(to), parallel)
    emit(rec, as_json, render_result)
    if not rec["met_deadline"]:
        raise SystemExit(2)


def run(the_lab: Any, node: str, deadline: float, to: list[str] | None, parallel: int | None) -> dict[str, Any]:
    """Run an evacuation with its live table on stderr (``lab notice`` and ``watch`` call it too)."""
    from podmigrate.engine.evacuate import Evacuation

    def report(msg: str) -> None:
        err.print(f"  • {msg}", highlight=False)

    with Live(Table(), console=err, refresh_per_second=4, transient=err.is_terminal) as live:
        ev = Evacuation(the_lab, node, deadline, to, parallel, report, lambda e: live.update(_progress(e)))
        return ev.run()


def _progress(ev: Any) -> Table:
    t = Table("workload", "GiB", "status", "way", "target", "T+s", "doing",
              title=f"evacuating {ev.node}: T+{ev.elapsed():.1f} s of {ev.deadline_s:.0f} s")  # fmt: skip
    for o in ev.outcomes.values():
        at = o.finished_at_s if o.finished_at_s is not None else o.started_at_s
        t.add_row(o.label, f"{o.memory / GB:.2f}", o.status, f"{o.mode or ''}/{o.transport or ''}".strip("/"),
                  o.target or "", f"{at:.1f}" if at is not None else "", o.doing or o.why[:60])  # fmt: skip
    return t


def render_plan(data: dict[str, Any]) -> None:
    p = data["plan"]
    title = f"plan: evacuate {data['node']}, {p['parallel']} at a time, deadline {p['deadline_s']:.0f} s"
    t = Table("workload", "GiB", "action", "way", "target", "lane", "start s", "end s", "blackout s", "why",
              title=title)  # fmt: skip
    label = {w["workload"]: w["label"] for w in data["workloads"]}
    for s in p["steps"]:
        t.add_row(label.get(s["workload"], s["workload"]), f"{s['memory'] / GB:.2f}", s["action"],
                  f"{s['mode']}/{s['transport']}" if s["mode"] else "-", s["target"] or "-", str(s["lane"] or 0),
                  f"{s['start_s']:.1f}", f"{s['end_s']:.1f}", f"{s['blackout_s']:.2f}", s["why"])  # fmt: skip
    out.print(t)
    out.print(f"predicted: empty at T+{p['predicted_end_s']:.1f} s, total blackout {p['total_blackout_s']:.2f} s, "
              f"{'fits' if p['fits'] else 'does NOT fit'}; parallelism considered (predicted end): "
              + ", ".join(f"{k}: {v:.1f} s" for k, v in p["considered"].items()))  # fmt: skip
    out.print("rates: " + "; ".join(f"{k} {v}" for k, v in data["rates"].items()))
    out.print(f"concurrency slowdown: {data['slowdown']['factors']} ({data['slowdown']['basis']})")


def render_result(rec: dict[str, Any]) -> None:
    t = Table("workload", "mode", "target", "blackout s", "MiB moved", "finished at T+s", "state", "status / why",
              title=f"evacuation {rec['id']} of {rec['node']}")  # fmt: skip
    for w in rec["workloads"]:
        t.add_row(w["label"], f"{w['mode']}/{w['transport']}" if w["mode"] else "-", w["target"] or "-",
                  f"{w['blackout_s']:.3f}" if w["blackout_s"] is not None else "-",
                  f"{w['bytes_moved'] / 2**20:.0f}" if w["bytes_moved"] is not None else "-",
                  f"{w['finished_at_s']:.1f}" if w["finished_at_s"] is not None else "-", w["state"] or "-",
                  w["status"] + (f": {w['why']}" if w["status"] not in ("moved",) and w["why"] else ""))  # fmt: skip
    out.print(t)
    mb = rec["median_blackout_s"]
    out.print(
        f"{rec['node']} {'empty' if rec['empty'] else 'NOT empty: ' + ', '.join(rec['left_running'])} at "
        f"T+{rec['time_to_empty_s']:.1f} s (deadline {rec['deadline_s']:.0f} s: "
        f"{'met' if rec['met_deadline'] else 'MISSED'}); median blackout "
        f"{f'{mb:.3f} s' if mb is not None else '-'}; state kept {rec['state_kept']}/{len(rec['workloads'])}"
    )
    if rec.get("parked"):
        out.print(f"parked in the registry, state and all: {', '.join(rec['parked'])} "
                  "(podmigrate parked; podmigrate restore NAME --to NODE)")  # fmt: skip
    for n, why in rec["failed_targets"].items():
        err.print(f"[yellow]target {n} failed:[/] {why}")


@lab.command("cordon")
@click.argument("node")
@click.pass_context
def lab_cordon(ctx: click.Context, node: str) -> None:
    """Keep new workloads and migrations off NODE (as kubectl cordon)."""
    from podmigrate import cordon

    the_lab = get_lab(ctx)
    the_lab.require_up()
    if node not in the_lab.nodes:
        raise click.BadParameter(f"no node {node!r}; the lab's nodes: {', '.join(the_lab.nodes)}")
    cordon.cordon(the_lab, node, "cordoned by hand")
    out.print(f"{node} cordoned")


@lab.command("uncordon")
@click.argument("node")
@click.pass_context
def lab_uncordon(ctx: click.Context, node: str) -> None:
    """Let workloads start on and migrate to NODE again."""
    from podmigrate import cordon

    was = cordon.uncordon(get_lab(ctx), node)
    out.print(f"{node} uncordoned" if was else f"{node} was not cordoned")


@lab.command("notice")
@click.argument("node")
@click.option("--in", "in_s", default=120.0, show_default=True, type=click.FloatRange(1, 3600),
              help="Seconds until the node goes (AWS Spot gives 120).")  # fmt: skip
@click.option("--action", default="terminate", show_default=True, type=click.Choice(["terminate", "stop", "hibernate"]))
@click.option("--detach", is_flag=True, help="Only post the notice (for a `podmigrate watch` running elsewhere).")
@click.option("--withdraw", is_flag=True, help="Take NODE's notice back, before its time.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def lab_notice(
    ctx: click.Context, node: str, in_s: float, action: str, detach: bool, withdraw: bool, as_json: bool
) -> None:
    """Simulate a Spot interruption notice for NODE: EC2's instance-action document served on the node,
    and at its time every container still on it stopped. Unless --detach, the lab's controller reacts
    at once as `podmigrate watch` would: it evacuates NODE by the deadline, then reports what the
    deadline stopped."""
    import time

    from podmigrate.engine import watch
    from podmigrate.lab import notice

    the_lab = get_lab(ctx)
    the_lab.require_up()
    if withdraw:
        out.print(f"{node}: notice withdrawn ({notice.withdraw(the_lab, node) or 'there was none'})")
        return
    posted = notice.post(the_lab, node, in_s, action)
    err.print(f"{node}: instance-action {posted['instance_action']} (terminator pid {posted['terminator_pid']})")
    if detach:
        emit(posted, as_json, lambda d: None)
        return
    doc = watch.pending(the_lab, [node])[node]
    rec = watch.handle(the_lab, node, doc, lambda n, left: run(the_lab, n, left, None, None), err.print)
    with status(f"waiting for {node}'s deadline ({doc['time']})"):
        while (gone := notice.terminated(the_lab, node)) is None and time.time() < doc["at"] + 30:
            time.sleep(0.2)
    rec["at_deadline"] = gone
    emit(rec, as_json, render_notice)
    if not rec.get("met_deadline") or gone is None or gone["stopped"]:
        raise SystemExit(2)


def render_notice(rec: dict[str, Any]) -> None:
    if "workloads" in rec:
        render_result(rec)
    else:
        err.print(f"[red]{rec['node']} not evacuated:[/] {rec.get('why')}")
    gone = rec.get("at_deadline")
    if gone is None:
        err.print("[yellow]the terminator did not report within 30 s of the deadline[/]")
    elif gone["stopped"]:
        out.print(f"at the deadline {rec['node']} stopped, NOT moved: {', '.join(gone['stopped'])}")
    else:
        out.print(f"at the deadline nothing was left running on {rec['node']}")


@click.command()
@click.option("--node", "nodes", multiple=True, help="Only these nodes (repeatable; default: every node).")
@click.option("--once", is_flag=True, help="Handle the notices there are now, then exit.")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.1, 60))
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def watch_cmd(ctx: click.Context, nodes: tuple[str, ...], once: bool, interval: float, as_json: bool) -> None:
    """Turn every Spot interruption notice on the lab's nodes into an evacuation by its deadline."""
    from podmigrate.engine import watch

    the_lab = get_lab(ctx)
    the_lab.require_up()

    def evacuate(node: str, left: float) -> dict[str, Any]:
        rec = run(the_lab, node, left, None, None)
        if not as_json:
            render_result(rec)
        return rec

    if not once:
        err.print(f"watching {', '.join(nodes) or 'every node'} of lab {the_lab.name} for interruption notices")
    done = watch.watch(the_lab, evacuate, list(nodes) or None, once, interval, err.print)
    if as_json:
        emit(done, True, lambda d: None)
