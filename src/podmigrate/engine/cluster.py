"""What the engine needs of the machines it migrates between, whoever provides them: the lab
(``lab.cluster.Lab``), the unit tests' fake lab (``tests/fake_lab.py``, agents answering in-process
with the same HTTP contract). The engine imports no lab module (an import-linter contract): a
provider conforms to these protocols by its shape.

A workload is reached at its own *service address*; the cluster's ``Router`` decides which node
that address's traffic goes to (the cutover), and its ``Observer`` is a client outside the nodes:
what the workload's users see (probes, reads of its state, the registry's listing). Where the
router moves no address (``moves_addresses`` False), a workload is reached at its host's address
and published ports instead, and changes address when it moves (``engine.phases.published``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from podmigrate.client import AgentClient


class Router(Protocol):
    def switch(self, address: str, node: str, drain: bool = False) -> dict[str, Any]:
        """Send ``address``'s traffic to ``node`` (``drain``: connections open to the old node may
        finish there): ``{"router", "addr", "started", "ended", "draining"?}``."""
        ...

    def end_drain(self, address: str, timeout: float) -> dict[str, Any]: ...  # every connection to the new node
    def routes(self) -> list[dict[str, Any]]: ...  # ``{"dst", "via"}`` for each address routed
    def remove(self, address: str) -> None: ...
    def close(self) -> None: ...


class Observer(Protocol):
    def get(self, url: str, timeout: float = 30.0) -> dict[str, Any]: ...  # ``{"ok", "status"?, "body"?}``
    def start_probe(self, probe: dict[str, Any]) -> str: ...  # host, port, path, interval: the probe's id
    def probe_records(self, probe_id: str) -> list[dict[str, Any]]: ...
    def stop_probe(self, probe_id: str) -> list[dict[str, Any]]: ...  # its records, not waiting for probes in flight
    def cancel_probe(self, probe_id: str) -> None: ...
    def close(self) -> None: ...


class Cluster(Protocol):
    name: str  # in messages
    dir: Path  # the state directory: migration records, claims, cordons, parked workloads, probe logs

    @property
    def nodes(self) -> list[str]: ...
    @property
    def registry(self) -> str: ...  # host:port of the registry checkpoint images go through
    @property
    def workload_network(self) -> str: ...  # the container network whose addresses can move
    def agent(self, name: str, timeout: float = 900.0) -> AgentClient: ...  # a node's agent
    def node_address(self, node: str) -> str: ...  # where the other nodes reach it
    def is_service_address(self, ip: str) -> bool: ...  # one the router may hold for a workload
    @property
    def moves_addresses(self) -> bool: ...  # False: a workload answers at its host's published ports
    @property
    def shared_segment(self) -> bool: ...  # True: whoever holds a service address answers ARP for it
    def traffic(self) -> Router: ...
    def observer(self) -> Observer: ...
    def require_up(self) -> None: ...  # an error, with what to do, when the cluster cannot be reached
