"""``podmigrate park``, ``restore`` and ``parked``: a container checkpointed into the registry when no
node can take it (``engine.controller.park``), restored later on any node with its state checked
(``engine.controller.restore``), and the list of what is parked (``engine.parking``).
"""

from __future__ import annotations

import time
from typing import Any

import click
from rich.table import Table

from podmigrate.cli.lab import get_lab
from podmigrate.cli.migrate import render_migration
from podmigrate.cli.output import emit, out, status


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@click.pass_context
def park(ctx: click.Context, name: str, as_json: bool) -> None:
    """Checkpoint running container NAME into the lab registry and stop it, to restore later."""
    from podmigrate.engine.controller import park as run_park

    with status(f"Parking {name} in the registry") as report:
        rec = run_park(get_lab(ctx), name, report)

    def render(r: dict[str, Any]) -> None:
        out.print(
            f"parked {name} from {r['source']} as {r['reference']} (sealed: {r['security'].get('sealed', False)})"
        )
        out.print(f"restore it with: podmigrate restore {name} --to NODE")

    emit(rec, as_json, render)


@click.command()
@click.argument("name")
@click.option("--to", "target", required=True, help="The node to restore it on.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@click.pass_context
def restore(ctx: click.Context, name: str, target: str, as_json: bool) -> None:
    """Restore parked container NAME on node TARGET, its memory as it was parked."""
    from podmigrate.engine.controller import restore as run_restore

    with status(f"Restoring {name} on {target} from the registry") as report:
        rec = run_restore(get_lab(ctx), name, target, report)

    def render(r: dict[str, Any]) -> None:
        render_migration(r)
        out.print(f"it was parked for {r.get('parked_for_s', 0):.1f} s (the blackout above is that outage)")

    emit(rec, as_json, render)


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def parked(ctx: click.Context, as_json: bool) -> None:
    """List the parked containers: where their checkpoints are, since when."""
    from podmigrate.engine import parking

    entries = parking.listing(get_lab(ctx))

    def render(es: list[dict[str, Any]]) -> None:
        t = Table("workload", "parked from", "since", "image", "MiB", "sealed")
        for e in es:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e["parked_at"])))
            t.add_row(str(e["workload"]), str(e["source"]), since, str(e["reference"]),
                      f"{int(e.get('bytes') or 0) / 2**20:.0f}", str(e["sealed"]))  # fmt: skip
        out.print(t)

    emit(entries, as_json, render)
