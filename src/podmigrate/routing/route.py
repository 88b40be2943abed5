"""Service-address cutover by kernel route: ``ip route replace ADDR/32 via NODE`` (stdlib only).

The workload keeps its address on every node (same podman subnet everywhere, routing instead of
NAT), so the LAN only has to learn which node now holds it. ``ip route replace`` is a single atomic
netlink operation: packets go to the old node until it returns and to the new one right after.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from podmigrate.routing import check, kernel_next_hop, run


def _ip(*args: str) -> str:
    return run(["ip", *args])


class RouteRouter:
    name = "route"

    def routes(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = json.loads(_ip("-j", "route", "show") or "[]")
        return [{"dst": r["dst"], "via": r.get("gateway")} for r in data if r.get("gateway")]

    def lookup(self, addr: str) -> str | None:
        """The next hop the kernel uses for ``addr`` right now."""
        return kernel_next_hop(addr)

    def switch(self, addr: str, via: str, drain: bool = False) -> dict[str, Any]:
        # a route is per packet: there is nothing to drain with (``drain`` asks for what nft does)
        addr, via = check(addr), check(via)
        before = self.lookup(addr)
        t0 = time.time()
        _ip("route", "replace", f"{addr}/32", "via", via)
        t1 = time.time()
        return {"addr": addr, "via": via, "previous": before, "started": t0, "ended": t1, "draining": False}

    def end_drain(self, addr: str, timeout: float) -> dict[str, Any]:
        return {"addr": check(addr), "drained_s": 0.0, "open": 0, "forced": False}

    def remove(self, addr: str) -> bool:
        p = subprocess.run(["ip", "route", "del", f"{check(addr)}/32"], capture_output=True, text=True)
        return p.returncode == 0

    def services(self) -> list[dict[str, Any]]:
        """The service addresses this router holds (host routes, not the nodes' ranges)."""
        return [r for r in self.routes() if "/" not in str(r["dst"])]

    def teardown(self) -> None:
        for r in self.services():
            self.remove(r["dst"])
