"""What every lab phase gets: the lab, the record, progress reporting and one client per agent.

Used by the phases beside this module; ``engine.controller`` makes one per migration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmigrate.client import AgentClient
from podmigrate.engine.cluster import Cluster, Observer, Router
from podmigrate.engine.record import Record, Store
from podmigrate.transport import seal

Report = Callable[[str], None]


@dataclass
class Ctx:
    lab: Cluster
    store: Store
    rec: Record
    report: Report
    clients: dict[str, AgentClient] = field(default_factory=dict)
    _router: Router | None = None
    _observer: Observer | None = None
    # this migration's checkpoint key: in this process's memory and the two agents' only (never in
    # the record: it is the one thing that would open a checkpoint left in a registry)
    seal_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.secure and self.seal_key is None:
            self.seal_key = seal.new_key()
        # what the phases found, as they found it: empty until something crossed (engine.record)
        self.rec.setdefault("security", {})

    @property
    def secure(self) -> bool:
        """Whether this migration seals its checkpoints and sends its pages under TLS: its plan's
        ``security`` (on unless a measurement asked for off), never a setting of the lab's."""
        return self.rec["plan"].get("security", "on") != "off"

    def seal(self) -> dict[str, Any]:
        """The request field that seals (or opens) this migration's checkpoints, if they are sealed."""
        return {"seal": self.seal_key} if self.seal_key else {}

    def criu_tls(self) -> dict[str, bool]:
        """The request field that tells an agent whether CRIU's own connections (a page server's, a
        lazy dump's) go under TLS: said in every such request, both ends alike (``agent.tls``)."""
        return {"criu_tls": self.secure}

    def agent(self, name: str) -> AgentClient:
        if name not in self.clients:
            self.clients[name] = self.lab.agent(name)
            self.rec["security"]["controller"] = self.clients[name].channel
        return self.clients[name]

    def traffic(self) -> Router:
        if self._router is None:
            self._router = self.lab.traffic()
        return self._router

    def observer(self) -> Observer:
        if self._observer is None:
            self._observer = self.lab.observer()
        return self._observer

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # every client closed, whichever fails
            for c in [*self.clients.values(), self._router, self._observer]:
                if c is not None:
                    stack.callback(c.close)
            self.clients.clear()
            self._router = self._observer = None
