"""Routers: how traffic for a workload's service address is switched from one node to another.

``route`` (the lab default) switches a /32 host route in the LAN namespace with one netlink call;
``nft`` switches an nftables map entry and can drain: connections open at the switch finish on the
old node. Routers run inside the LAN agent (standard library only).
"""

from __future__ import annotations

from typing import Any, Protocol

from podmigrate.errors import UsageError

NAMES = ("route", "nft")


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
