"""``podmigrate workload ...``: start, read and stop the stateful test workload (``workload.manage``)."""

from __future__ import annotations

from typing import Any

import click

from podmigrate.cli.lab import get_lab
from podmigrate.cli.output import emit, err, out, status


@click.group()
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

    with status(f"Starting {name} on {node}") as report:
        st = manage.start(get_lab(ctx), name, node, heap_mb, sidecar=sidecar, seed=seed, report=report)
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
