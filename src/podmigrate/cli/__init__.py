"""The command line: each command parses its options and makes one library call.

Errors print as ``ERROR: message`` plus a hint and the details that help (CRIU log lines, a
failing command's output); ``-v`` adds the traceback. This module holds the ``main`` group (the
``podmigrate`` entry point); the commands live by group beside it: ``lab``, ``workload``,
``migrate`` (migrate, history, gc), ``park`` (park, restore, parked), ``evacuate`` (evacuate,
watch, lab notice/cordon/uncordon), ``bench`` and ``bench_runs`` (bench, report, demo), ``k8s`` and
``hosts``; ``output`` prints.
"""

from __future__ import annotations

from typing import Any

import click

from podmigrate.cli import bench, bench_runs, evacuate, hosts, k8s, kube, lab, migrate, park, workload
from podmigrate.cli.output import fail
from podmigrate.errors import PodmigrateError

__all__ = ["Cli", "main"]


class Cli(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PodmigrateError as e:
            fail(e, bool(ctx.obj and ctx.obj.get("verbose")))


@click.group(cls=Cli)
@click.option(
    "--lab", "lab_name", default="default", envvar="PODMIGRATE_LAB", show_default=True, help="Which lab to act on."
)
@click.option(
    "--hosts",
    "hosts_file",
    type=click.Path(dir_okay=False),
    help="Migrate between the hosts of this inventory instead of a lab (docs/hosts.md): migrate, history.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@click.pass_context
def main(ctx: click.Context, lab_name: str, hosts_file: str | None, verbose: bool) -> None:
    """podmigrate: live-migrate stateful containers with CRIU, and measure what it costs."""
    ctx.obj = {"lab": lab_name, "hosts": hosts_file, "verbose": verbose}


main.add_command(lab.lab)
main.add_command(workload.workload)
main.add_command(migrate.migrate)
main.add_command(migrate.history)
main.add_command(migrate.gc)
main.add_command(park.park)
main.add_command(park.restore)
main.add_command(park.parked)
main.add_command(evacuate.evacuate)
main.add_command(evacuate.watch_cmd, "watch")
main.add_command(bench.demo)
for cmd in (bench_runs.bench_soak, bench_runs.bench_evacuate, bench_runs.bench_faults, bench_runs.bench_k8s):
    bench.bench.add_command(cmd)
main.add_command(bench.bench)
main.add_command(bench.report_cmd)
main.add_command(k8s.k8s_group)
main.add_command(kube.kube)
main.add_command(hosts.hosts)
