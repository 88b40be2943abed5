"""What the engine and the workload helpers need of a lab: its nodes, its state directory and a
client per agent. ``lab.cluster.Lab`` is the real one; the unit tests' fake lab (``tests/fake_lab.py``)
is another, whose agents answer in-process with the same HTTP contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from podmigrate.client import AgentClient


class LabHandle(Protocol):
    name: str
    dir: Path  # the lab's state directory: the migration records, probe logs

    @property
    def nodes(self) -> list[str]: ...
    def agent(self, name: str, timeout: float = 900.0) -> AgentClient: ...  # a node's agent, or "lan"
    def require_up(self) -> None: ...  # LabError, with what to do, when the lab is not up
