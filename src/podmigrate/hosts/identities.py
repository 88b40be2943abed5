"""``podmigrate hosts init``: the identities of an inventory's hosts and its controller, and each
host's agent bundle.

One CA (``<state>/pki``), a certificate per host (its name and address) and one for the controller.
An agent lets in over TCP only certificates of this CA that name a host of the inventory (``--peer``:
they may hand it a checkpoint) or the controller (``--controller``: every route): the certificate is
the identity, no token and no shared file. For each host
a bundle directory ``<state>/bundles/<host>`` holds ``ca.crt``, ``agent.crt``, ``agent.key`` (0600)
and ``agent.env``, the agent's arguments (its name, where it listens, each host's address): what
``podmigrate hosts install-agent`` puts in ``/etc/podmigrate`` on that host. Running it again keeps
every certificate still valid (``pki``: 30 days, renewed within 2 of their end).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from podmigrate.errors import UsageError
from podmigrate.hosts.inventory import AGENT_PORT, CONTROLLER, ROUTER, Inventory
from podmigrate.pki import CA, Identity

ETC = Path("/etc/podmigrate")  # where a host's agent reads its bundle


def agent_args(inv: Inventory, host: str, etc: Path = ETC) -> list[str]:
    if host == ROUTER and inv.router_address:  # the static router's: routes only, for the controller
        return [
            "--role", "lan", "--name", ROUTER, "--tcp", f"{inv.router_address}:{AGENT_PORT}",
            "--tls-cert", str(etc / "agent.crt"), "--tls-key", str(etc / "agent.key"), "--tls-ca", str(etc / "ca.crt"),
            "--controller", CONTROLLER, "--router-file", str(etc / "router"),
        ]  # fmt: skip
    me = inv.host(host)
    return [
        "--role", "node", "--name", me.name, "--tcp", f"{me.address}:{AGENT_PORT}",
        "--tls-cert", str(etc / "agent.crt"), "--tls-key", str(etc / "agent.key"), "--tls-ca", str(etc / "ca.crt"),
        *(a for h in inv.hosts for a in ("--peer", h.name)), "--controller", CONTROLLER,
        *(a for h in inv.hosts for a in ("--node-address", f"{h.name}={h.address}")),
    ]  # fmt: skip


def controller(inv: Inventory) -> Identity:
    """The controller's certificate, as ``init`` made it (never a new CA: every bundle hangs on it)."""
    pki = inv.state / "pki"
    ident = Identity(CONTROLLER, pki / f"{CONTROLLER}.crt", pki / f"{CONTROLLER}.key", pki / "ca.crt")
    if not all(p.is_file() for p in (ident.cert, ident.key, ident.ca)):
        raise UsageError(f"no controller identity in {pki}", hint=f"run: podmigrate hosts init {inv.path}")
    return ident


def init(inv: Inventory) -> dict[str, Path]:
    """Each host's bundle directory, made or brought up to date."""
    ca = CA(inv.state / "pki", _label(inv))
    ca.issue(CONTROLLER)
    out: dict[str, Path] = {}
    for name, address in ((m.name, m.address) for m in inv.machines()):
        ident = ca.issue(name, ips=[address], file=f"host-{name}")
        d = inv.state / "bundles" / name
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        for src, file, mode in ((ident.ca, "ca.crt", 0o644), (ident.cert, "agent.crt", 0o644),
                                (ident.key, "agent.key", 0o600)):  # fmt: skip
            shutil.copyfile(src, d / file)
            os.chmod(d / file, mode)
        (d / "agent.env").write_text(f"PODMIGRATE_AGENT_ARGS={shlex.quote(shlex.join(agent_args(inv, name)))}\n")
        out[name] = d
    return out


def _label(inv: Inventory) -> str:
    return f"hosts {inv.path.stem}"
