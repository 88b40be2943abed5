"""A node agent turns the node names the engine sends into addresses: the lab's plan when told
nothing, exactly the hosts it was told of otherwise (``agent.peers``)."""

from __future__ import annotations

import pytest

from podmigrate import layout
from podmigrate.agent.peers import Peers
from podmigrate.errors import UsageError


def test_an_agent_told_nothing_is_a_lab_node() -> None:
    peers = Peers.parse("node-a", [])
    assert peers.mine() == layout.node_ip("node-a") and peers.address("node-b") == layout.node_ip("node-b")


def test_an_agent_told_its_hosts_knows_those_and_refuses_any_other() -> None:
    peers = Peers.parse("host-a", ["host-a=192.0.2.11", " host-b = 2001:db8::12 "])
    assert (peers.mine(), peers.address("host-b")) == ("192.0.2.11", "2001:db8::12")
    with pytest.raises(UsageError, match=r"node 'node-b' is not one this agent was told of \(\['host-a', 'host-b'\]\)"):
        peers.address("node-b")  # never the lab's plan on hosts


@pytest.mark.parametrize("pair", ["host-b", "host-b=", "=192.0.2.12", "host-b=192.0.2.300"])
def test_a_malformed_address_is_refused_with_what_to_give(pair: str) -> None:
    with pytest.raises(UsageError, match="is not NAME=IP") as e:
        Peers.parse("host-a", ["host-a=192.0.2.11", pair])
    assert "--node-address host-b=192.0.2.12" in (e.value.hint or "")


def test_the_agents_own_address_must_be_among_them() -> None:
    with pytest.raises(UsageError, match=r"no --node-address for this node \('host-a'\)") as e:
        Peers.parse("host-a", ["host-b=192.0.2.12"])
    assert "--node-address host-a=IP" in (e.value.hint or "")
