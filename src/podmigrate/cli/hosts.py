"""``podmigrate hosts``: machines that are not the lab. ``init`` makes an inventory's identities and
each host's agent bundle (``hosts.identities``); ``install-agent``, run on a host, installs its agent
as a systemd service from this package (``hosts.agent_unit``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from podmigrate.cli.output import emit, out


@click.group()
def hosts() -> None:
    """Hosts running Podman that are not the lab (docs/hosts.md)."""


@hosts.command("init")
@click.argument("inventory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the bundles' paths as JSON.")
def init_cmd(inventory: Path, as_json: bool) -> None:
    """A CA, a certificate per host of INVENTORY and for the controller, and each host's agent bundle."""
    from podmigrate.hosts import identities
    from podmigrate.hosts import inventory as inv_mod

    inv = inv_mod.load(inventory)
    bundles = {name: str(path) for name, path in identities.init(inv).items()}

    def render(b: dict[str, Any]) -> None:
        for name, path in b.items():
            out.print(f"{name}: {path}  (copy it to {name}, then there: podmigrate hosts install-agent DIR)")

    emit(bundles, as_json, render)


@hosts.command("install-agent")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--root", type=click.Path(path_type=Path), default=Path("/"), show_default=True,
              help="Write under this root instead, and start nothing.")  # fmt: skip
def install_agent(bundle: Path, root: Path) -> None:
    """On a host: its agent from BUNDLE (made by `hosts init`), as the systemd service podmigrate-agent."""
    from podmigrate.hosts import agent_unit

    done = agent_unit.install(bundle, root)
    out.print(f"bundle in {done['etc']}, unit {done['unit']}" + (", started" if root == Path("/") else ""))


@hosts.command("status")
@click.argument("inventory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print each agent's answer as JSON.")
def status_cmd(inventory: Path, as_json: bool) -> None:
    """Each host's agent, asked over TLS as the controller: its runtime and CRIU, or why it did not answer."""
    from podmigrate.errors import PodmigrateError
    from podmigrate.hosts import inventory as inv_mod
    from podmigrate.hosts.cluster import Hosts

    got = Hosts(inv_mod.load(inventory)).status()

    def render(st: dict[str, dict[str, Any]]) -> None:
        table = Table("host", "address", "agent", "runtime", "criu")
        for name, h in st.items():
            if h["up"] and h.get("role") == "lan":  # the static router's agent: routes, no runtime
                table.add_row(name, h["address"], "up", f"router ({h.get('router', '?')} routes)", "")
            elif h["up"]:
                runtime = f"{h.get('runtime', '?')} {h.get('podman', '')}".strip()
                table.add_row(name, h["address"], "up", runtime, str(h.get("criu", "?")))
            else:
                table.add_row(name, h["address"], f"[red]{h['error']}[/red]", "", "")
        out.print(table)

    emit(got, as_json, render)
    if down := [n for n, h in got.items() if not h["up"]]:
        raise PodmigrateError(f"{len(down)} of {len(got)} agents did not answer: {', '.join(down)}",
                              hint="on each: systemctl status podmigrate-agent (docs/hosts.md)")  # fmt: skip
