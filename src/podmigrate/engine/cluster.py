"""What the engine needs of the machines it migrates between, whoever provides them: the lab
(``lab.cluster.Lab``), the unit tests' fake lab (``tests/fake_lab.py``, agents answering in-process
with the same HTTP contract). The engine imports no lab module (an import-linter contract): a
provider conforms to this protocol by its shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from podmigrate.client import AgentClient


class Cluster(Protocol):
    name: str  # in messages
    dir: Path  # the state directory: migration records, claims, cordons, parked workloads, probe logs

    @property
    def nodes(self) -> list[str]: ...
    def agent(self, name: str, timeout: float = 900.0) -> AgentClient: ...  # a node's agent, or "lan"
    def require_up(self) -> None: ...  # an error, with what to do, when the cluster cannot be reached
