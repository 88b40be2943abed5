"""``podmigrate lab ...``: create, inspect, enter and remove the local lab (``podmigrate.lab``).

``get_lab`` is the lab every command acts on (``--lab``); the other command modules use it too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from podmigrate.cli.output import emit, err, out, status
from podmigrate.errors import UsageError

if TYPE_CHECKING:
    from podmigrate.engine.cluster import Cluster
    from podmigrate.lab.cluster import Lab


def get_lab(ctx: click.Context) -> Lab:
    """The lab named by ``--lab``; imported here, not at the top, so that `--help` stays fast."""
    from podmigrate.lab.cluster import Lab

    if ctx.obj.get("hosts"):
        raise UsageError(f"`{ctx.command_path}` acts on a lab, not on --hosts", hint="leave out --hosts")
    return Lab(ctx.obj["lab"])


def get_cluster(ctx: click.Context) -> Cluster:
    """The hosts of ``--hosts INVENTORY`` (docs/hosts.md), or else the lab named by ``--lab``."""
    if ctx.obj.get("hosts"):
        from podmigrate.hosts import inventory
        from podmigrate.hosts.cluster import Hosts

        return Hosts(inventory.load(Path(ctx.obj["hosts"])))
    return get_lab(ctx)


@click.group()
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
@click.option(
    "--runtime",
    type=click.Choice(["podman", "containerd"]),
    default="podman",
    show_default=True,
    help="Podman alone, or containerd 2.1 as well on every node, with its CRI socket (the Kubernetes path).",
)
@click.option(
    "--firewall",
    type=click.Choice(["none", "nftables"]),
    default="none",
    show_default=True,
    help="Podman's firewall on the nodes: none (the lab's routed addresses, no NAT), or nftables (NAT and "
    "published ports, as on a plain host: for `lab inventory` and --hosts; docs/hosts.md).",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def lab_up(ctx: click.Context, nodes: int, router: str | None, runtime: str, firewall: str, as_json: bool) -> None:
    """Build the node image if needed and start the lab (idempotent)."""
    from podmigrate.workload.image import ready_lab

    the_lab = get_lab(ctx)
    with status(f"Lab {the_lab.name!r} up") as report:
        st = ready_lab(the_lab, nodes=nodes, report=report, router=router, runtime=runtime, firewall=firewall)
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
            str(a.get("criu", "-")) + (" +podmigrate" if (a.get("capabilities") or {}).get("lazy_dump_read") else ""),
            ctrs or "-",
        )
    out.print(t)


@lab.command("inventory")
@click.option("--router", type=click.Choice(["none", "l2", "static"]), default="none", show_default=True,
              help="static: the LAN agent routes the service addresses (network: the lab's own, mig)")  # fmt: skip
@click.option("--network", default="podman", show_default=True, help="The containers' network (l2: the LAN's).")
@click.pass_context
def lab_inventory(ctx: click.Context, router: str, network: str) -> None:
    """Write an inventory of the lab's nodes as hosts, for `podmigrate --hosts` (docs/hosts.md)."""
    from podmigrate.lab import hosts_view

    path = hosts_view.inventory(get_lab(ctx), router, network)
    out.print(str(path))
    err.print(f"from the lab's LAN: podmigrate --lab {ctx.obj['lab']} lab lan -- podmigrate --hosts {path} ...")


@lab.command("lan", context_settings={"ignore_unknown_options": True})
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def lab_lan(ctx: click.Context, argv: tuple[str, ...]) -> None:
    """Run a command of this machine in the lab's LAN network namespace (where the nodes' addresses are)."""
    import subprocess

    from podmigrate.lab import hosts_view

    sys.exit(subprocess.call(hosts_view.lan_argv(get_lab(ctx), list(argv))))


@lab.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("target")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def lab_exec(ctx: click.Context, target: str, argv: tuple[str, ...]) -> None:
    """Run a command on a node (node-a, ...), on the LAN (lan) or in the lab namespace (lab)."""
    sys.exit(get_lab(ctx).exec_interactive(target, list(argv)))
