"""The lab's nodes seen as hosts (docs/hosts.md): an inventory of them, so that ``podmigrate
--hosts`` drives the lab as it would two machines of a user's, through the nodes' agents over TCP
with certificates only (no Unix socket, no lab token) and router ``none``.

The nodes' agents let in the lab CA's controller certificate (``lab.init``); the inventory's state
directory is the lab's own, whose ``pki`` holds that CA. The nodes' addresses are on the lab's LAN:
the controller runs in the LAN's network namespace (``lan_argv``), with this machine's files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from podmigrate import layout
from podmigrate.errors import LabError
from podmigrate.lab.cluster import Lab
from podmigrate.pki import CA


def inventory(lab: Lab, router: str = "none", network: str = "podman") -> Path:
    """``hosts-ROUTER.toml`` in the lab's directory, and the controller's certificate beside the
    lab's. ``l2``: ``network`` is a Podman network on the LAN's segment (a macvlan on each node's
    ``eth0``, which the user creates as on real hosts; docs/hosts.md)."""
    lab.require_up()
    CA(lab.dir / "pki", f"lab {lab.name}").issue(layout.CONTROLLER)
    hosts = "".join(f'\n[hosts.{n}]\naddress = "{lab.node_address(n)}"\n' for n in lab.nodes)
    path = lab.dir / f"hosts-{router}.toml"
    routing = f'[router]\naddress = "{layout.LAN_GATEWAY}"\n' if router == "static" else f'router = "{router}"\n'
    path.write_text(
        f"# the nodes of lab {lab.name!r} as hosts (podmigrate lab inventory)\n"
        f'state = "."\nregistry = "{layout.REGISTRY}"\nnetwork = "{network}"\n{routing}{hosts}'
    )
    return path


def lan_argv(lab: Lab, argv: Sequence[str]) -> list[str]:
    """``argv`` run in the lab's LAN network namespace (where the nodes' addresses are), otherwise as
    on this machine: its files, its Python, its environment."""
    lan = lab.service("lan")
    if lan is None:
        raise LabError(f"lab {lab.name!r} has no LAN agent running", hint="podmigrate lab status; podmigrate lab up")
    return ["nsenter", "-t", str(lan.pid), "-n", "--", *argv]
