"""What every lab phase gets: the lab, the record, progress reporting and one client per agent.

Used by the phases beside this module; ``engine.controller`` makes one per migration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from podmigrate.client import AgentClient
from podmigrate.engine.record import Record, Store
from podmigrate.lab.handle import LabHandle

Report = Callable[[str], None]


@dataclass
class Ctx:
    lab: LabHandle
    store: Store
    rec: Record
    report: Report
    clients: dict[str, AgentClient] = field(default_factory=dict)

    def agent(self, name: str) -> AgentClient:
        if name not in self.clients:
            self.clients[name] = self.lab.agent(name)
        return self.clients[name]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()
