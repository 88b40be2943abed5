"""What every lab phase gets: the lab, the record, progress reporting and one client per agent.

Used by the phases beside this module; ``engine.controller`` makes one per migration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmigrate.agent import tls
from podmigrate.client import AgentClient
from podmigrate.engine import paths
from podmigrate.engine.record import Record, Store
from podmigrate.lab.handle import LabHandle
from podmigrate.transport import seal

Report = Callable[[str], None]


@dataclass
class Ctx:
    lab: LabHandle
    store: Store
    rec: Record
    report: Report
    clients: dict[str, AgentClient] = field(default_factory=dict)
    # this migration's checkpoint key: in this process's memory and the two agents' only (never in
    # the record: it is the one thing that would open a checkpoint left in a registry)
    seal_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        on = tls.enabled(self.lab.dir / "security")
        if on and self.seal_key is None:
            self.seal_key = seal.new_key()
        self.rec.setdefault("security", {"sealed": on, "criu_tls": on, "agents": "mutual TLS"})

    def seal(self) -> dict[str, Any]:
        """The request field that seals (or opens) this migration's checkpoints, if they are sealed
        (with ``digest`` when a sealed stream is to be hashed on both ends as well: the old path)."""
        if not (self.rec["security"]["sealed"] and self.seal_key):
            return {}
        return {"seal": self.seal_key, **({"digest": True} if paths.old("sha256-of-sealed-streams") else {})}

    def agent(self, name: str) -> AgentClient:
        if name not in self.clients:
            self.clients[name] = self.lab.agent(name)
        return self.clients[name]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()
