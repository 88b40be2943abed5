"""Where a node's agent reaches the other nodes, and where it is reached itself.

The engine names nodes, never addresses (``send to node-b``); each agent turns a name into an address.
Told at start (``--node-address NAME=IP``, repeated: hosts that are not the lab, whose addresses an
inventory gives), an agent knows exactly those nodes and refuses any other; told nothing, it is a
lab's node and uses the lab's address plan (``layout``). Standard library only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from podmigrate import layout
from podmigrate.errors import UsageError


class Peers:
    def __init__(self, own: str, addresses: dict[str, str] | None = None):
        self.own, self.addresses = own, dict(addresses or {})

    @classmethod
    def parse(cls, own: str, pairs: Iterable[str]) -> Peers:
        """From ``NAME=IP`` strings; a malformed one is refused with what was wrong."""
        addresses: dict[str, str] = {}
        for pair in pairs:
            name, _, ip = pair.partition("=")
            try:
                if not name.strip():
                    raise ValueError(pair)
                addresses[name.strip()] = str(ipaddress.ip_address(ip.strip()))
            except ValueError:
                raise UsageError(f"--node-address {pair!r} is not NAME=IP",
                                 hint="for example --node-address host-b=192.0.2.12") from None  # fmt: skip
        if addresses and own not in addresses:
            raise UsageError(f"no --node-address for this node ({own!r}) among {sorted(addresses)}",
                             hint=f"add --node-address {own}=IP: the address its peers reach it at")  # fmt: skip
        return cls(own, addresses)

    def address(self, node: str) -> str:
        if not self.addresses:
            return layout.node_ip(node)
        if node not in self.addresses:
            raise UsageError(f"node {node!r} is not one this agent was told of ({sorted(self.addresses)})",
                             hint=f"start the agent with --node-address {node}=IP as well")  # fmt: skip
        return self.addresses[node]

    def mine(self) -> str:
        return self.address(self.own)
