"""Routers: how traffic for a workload's service address is switched from one node to another.

``route`` (the lab default) switches a /32 host route in the LAN namespace with one netlink call;
``nft`` switches an nftables map entry and can drain: connections open at the switch finish on the
old node. Routers run inside the LAN agent (standard library only).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from typing import Any, Protocol

from podmigrate.errors import RoutingError, UsageError

NAMES = ("route", "nft")


def run(argv: list[str], stdin: str | None = None) -> str:
    """Run a routing command (ip, nft); its stdout, or a RoutingError with its stderr."""
    p = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if p.returncode:
        what = " ".join(argv) + (f" <<< {stdin.strip()!r}" if stdin else "")
        raise RoutingError(f"{what} failed: {p.stderr.strip()}")
    return p.stdout


def check(addr: str) -> str:
    """A service or node address: IPv4 (service addresses are /32s)."""
    try:
        return str(ipaddress.IPv4Address(addr))
    except ValueError as e:
        raise UsageError(f"not an IPv4 address: {addr!r}") from e


def kernel_next_hop(addr: str) -> str | None:
    """The next hop the kernel's routing tables give ``addr`` right now (None: unreachable)."""
    p = subprocess.run(["ip", "-j", "route", "get", check(addr)], capture_output=True, text=True)
    data = json.loads(p.stdout or "[]") if p.returncode == 0 else []
    return data[0].get("gateway") if data else None


class Router(Protocol):
    name: str

    def routes(self) -> list[dict[str, Any]]: ...
    def services(self) -> list[dict[str, Any]]: ...
    def lookup(self, addr: str) -> str | None: ...
    def switch(self, addr: str, via: str, drain: bool = False) -> dict[str, Any]: ...
    def end_drain(self, addr: str, timeout: float) -> dict[str, Any]: ...
    def remove(self, addr: str) -> bool: ...
    def teardown(self) -> None: ...


def make(name: str) -> Router:
    if name == "route":
        from podmigrate.routing.route import RouteRouter

        return RouteRouter()
    if name == "nft":
        from podmigrate.routing.nft import NftRouter

        return NftRouter()
    raise UsageError(f"no router named {name!r}", hint=f"choose one of: {', '.join(NAMES)}")


def replace(old: Router, new_name: str) -> Router:
    """Hand every service address from ``old`` to a new router without a moment unrouted: the new
    router takes each address before the old one lets go (both send it to the same node)."""
    new = make(new_name)
    for r in old.services():
        new.switch(str(r["dst"]), str(r["via"]))
    old.teardown()
    return new
