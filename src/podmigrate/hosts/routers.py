"""The hosts' routers. ``none``: nothing in the network changes, a workload answers where it runs
(``engine.phases.published``). ``l2``: service addresses on one L2 segment every host shares (a
macvlan or bridged Podman network of one subnet, the inventory's ``network``). A workload keeps its
address when it moves, so its clients' open TCP connections move with it: the source gave it up
before its freeze (``engine.phases.segment``), and at the cutover every other host's agent makes
sure no interface there carries it, then the target's sends gratuitous ARP from the copy
(``runtime.l2``). Nothing is held between migrations: the segment itself is the routing table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from podmigrate.client import AgentClient


class NoRouter:
    """Router ``none``: nothing in the network changes; the workload answers where it runs now."""

    def switch(self, address: str, node: str, drain: bool = False) -> dict[str, Any]:
        now = time.time()
        return {"router": "none", "addr": address, "node": node, "started": now, "ended": now}

    def end_drain(self, address: str, timeout: float) -> dict[str, Any]:
        return {"router": "none", "addr": address, "drained": True}

    def routes(self) -> list[dict[str, Any]]:
        return []

    def remove(self, address: str) -> None:
        return None

    def close(self) -> None:
        return None


class L2Router(NoRouter):
    def __init__(self, nodes: list[str], agent: Callable[[str], AgentClient]):
        self.nodes, self.agent = nodes, agent

    def switch(self, address: str, node: str, drain: bool = False) -> dict[str, Any]:
        started = time.time()
        withdrawn = []
        for other in (n for n in self.nodes if n != node):
            with contextlib.closing(self.agent(other)) as a:
                withdrawn += a.post("/v1/l2/withdraw", {"address": address})["withdrawn"]
        with contextlib.closing(self.agent(node)) as a:
            announced = a.post("/v1/l2/announce", {"address": address})
        return {"router": "l2", "addr": address, "node": node, "withdrawn": withdrawn,
                "interface": announced["interface"], "started": started, "ended": time.time()}  # fmt: skip
