"""Service-address cutover by an nftables map and policy routing, conntrack-aware (stdlib only).

The LAN keeps one map, ``owner``: service address -> the node that holds it, stored as a packet
mark (the node's IPv4 address as a 32-bit number). A mangle rule marks every packet for a service
address with its owner, and one policy rule per node (``fwmark M lookup M``, table M routes via that
node) sends it there. Moving a service is one nftables transaction (replace the map element), so the
kernel switches every later packet at once, like ``ip route replace``.

What a route cannot do: each new connection also records its node in its conntrack entry
(``ct mark``). While a service address is in the ``draining`` set, packets of connections that began
before the switch keep going to their old node and only new connections go to the new one, so
requests in flight at the cutover finish where they started (make-before-break for the decoupled
mode; without it a SYN answered by the old node is followed by an ACK to the new one, which resets
it). Draining ends when no such connection is left open or after a deadline; from then on all
packets follow the owner again, which is also what stop-copy wants: its restored TCP connections
must reach the target at once, so it switches without draining.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
from typing import Any

from podmigrate.routing import check, kernel_next_hop, libnft, run

TABLE = "podmigrate"
RULE_PRIORITY = 1000  # ahead of the main table, where each node's container range is routed
# conntrack states of a connection that may still carry a request (not TIME_WAIT, CLOSE, ...)
OPEN_STATES = ("SYN_SENT", "SYN_RECV", "ESTABLISHED")
# An unanswered SYN stays in conntrack for minutes after its client gave up (closing a connecting
# socket sends nothing): only a SYN younger than this is a handshake still in progress.
SYN_AGE = 2.0

# Forwarded packets (clients in other namespaces) are marked in prerouting; the LAN's own sockets
# (the prober, the agent's HTTP client) in a route-type output chain, which makes the kernel route
# the packet again after its mark changed.
_CHAIN = """\
    ip daddr @draining ct mark != 0 meta mark set ct mark counter accept
    ct state new ct mark set ip daddr map @owner
    meta mark set ip daddr map @owner
"""
RULESET = f"""\
table ip {TABLE} {{
  set draining {{ type ipv4_addr; }}
  map owner {{ type ipv4_addr : mark; }}
  chain pre {{
    type filter hook prerouting priority mangle; policy accept;
{_CHAIN}  }}
  chain out {{
    type route hook output priority mangle; policy accept;
{_CHAIN}  }}
}}
"""


def mark_of(node_ip: str) -> int:
    return int(ipaddress.IPv4Address(node_ip))


def ip_of(mark: int) -> str:
    return str(ipaddress.IPv4Address(mark))


def _syn_timeout() -> int:
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_syn_sent") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 120


def pinned_elsewhere(addr: str, owner: int | None, table: str = "/proc/net/nf_conntrack") -> int:
    """Open connections to ``addr`` pinned to a node other than ``owner`` (they may still carry a
    request)."""
    n = 0
    syn_timeout = _syn_timeout()
    try:
        with open(table) as f:
            for line in f:
                # ipv4 2 tcp 6 TIMEOUT STATE src=... dst=... ... mark=M zone=Z use=U
                fields = line.split()
                if f"dst={addr}" not in fields or len(fields) < 6 or fields[5] not in OPEN_STATES:
                    continue
                if fields[5] == "SYN_SENT" and int(fields[4]) < syn_timeout - SYN_AGE:
                    continue
                mark = next((int(x[5:]) for x in fields if x.startswith("mark=")), 0)
                if mark and mark != owner:
                    n += 1
    except FileNotFoundError:  # kernel without CONFIG_NF_CONNTRACK_PROCFS: cannot tell, assume none
        return 0
    return n


class NftRouter:
    name = "nft"

    def __init__(self) -> None:
        self._ensure_table()
        self._nodes: set[int] = set()  # marks whose rule and table exist: the cutover skips the check

    def _ensure_table(self) -> None:
        p = subprocess.run(["nft", "list", "table", "ip", TABLE], capture_output=True, text=True)
        if p.returncode:  # a restarted agent keeps the table and its owners as they are
            libnft.run(RULESET)

    def _owners(self) -> dict[str, int]:
        data = json.loads(libnft.run(f"list map ip {TABLE} owner", json=True))
        for obj in data["nftables"]:
            if "map" in obj:
                return {e[0]: int(e[1]) for e in obj["map"].get("elem", [])}
        return {}

    def _draining(self) -> set[str]:
        data = json.loads(libnft.run(f"list set ip {TABLE} draining", json=True))
        for obj in data["nftables"]:
            if "set" in obj:
                return set(obj["set"].get("elem", []))
        return set()

    @staticmethod
    def _rule_marks() -> set[int]:
        rules = json.loads(run(["ip", "-j", "rule", "show", "priority", str(RULE_PRIORITY)]) or "[]")
        return {int(str(r["fwmark"]), 0) for r in rules if r.get("fwmark")}

    def _ensure_node(self, via: str) -> None:
        """The policy rule and table that send packets marked for ``via`` to it (idempotent)."""
        m = mark_of(via)
        if m in self._nodes:
            return
        run(["ip", "route", "replace", "default", "via", via, "table", str(m)])
        if m not in self._rule_marks():
            run(["ip", "rule", "add", "priority", str(RULE_PRIORITY), "fwmark", str(m), "lookup", str(m)])
        self._nodes.add(m)

    def routes(self) -> list[dict[str, Any]]:
        draining = self._draining()
        return [{"dst": a, "via": ip_of(m), "draining": a in draining} for a, m in sorted(self._owners().items())]

    def services(self) -> list[dict[str, Any]]:
        return self.routes()

    def lookup(self, addr: str) -> str | None:
        addr = check(addr)
        m = self._owners().get(addr)
        return ip_of(m) if m is not None else kernel_next_hop(addr)

    def switch(self, addr: str, via: str, drain: bool = False) -> dict[str, Any]:
        addr, via = check(addr), check(via)
        before = self.lookup(addr)
        self._ensure_node(via)
        # one transaction: no packet sees the service without an owner, or with half a change
        batch = (
            f"destroy element ip {TABLE} owner {{ {addr} }}\n"
            f"add element ip {TABLE} owner {{ {addr} : {mark_of(via)} }}\n"
            + (
                f"add element ip {TABLE} draining {{ {addr} }}\n"
                if drain
                else f"destroy element ip {TABLE} draining {{ {addr} }}\n"
            )
        )
        t0 = time.time()
        libnft.run(batch)
        t1 = time.time()
        return {"addr": addr, "via": via, "previous": before, "started": t0, "ended": t1, "draining": drain}

    def end_drain(self, addr: str, timeout: float) -> dict[str, Any]:
        """Wait until no connection pinned to another node is open (or ``timeout``), then let all
        packets follow the owner."""
        addr = check(addr)
        t0 = time.time()
        owner = self._owners().get(addr)
        if addr not in self._draining():
            return {"addr": addr, "drained_s": 0.0, "open": 0, "forced": False}
        deadline = time.monotonic() + timeout
        while True:
            pinned = pinned_elsewhere(addr, owner)
            if pinned == 0 or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        libnft.run(f"destroy element ip {TABLE} draining {{ {addr} }}")
        return {"addr": addr, "drained_s": round(time.time() - t0, 4), "open": pinned, "forced": pinned > 0}

    def remove(self, addr: str) -> bool:
        addr = check(addr)
        existed = addr in self._owners()
        libnft.run(f"destroy element ip {TABLE} owner {{ {addr} }}\ndestroy element ip {TABLE} draining {{ {addr} }}\n")
        return existed

    def teardown(self) -> None:
        """Remove the table, the policy rules and their tables (when another router takes over)."""
        self._nodes.clear()
        for m in self._rule_marks():
            subprocess.run(["ip", "rule", "del", "priority", str(RULE_PRIORITY), "fwmark", str(m)], capture_output=True)
            subprocess.run(["ip", "route", "flush", "table", str(m)], capture_output=True)
        subprocess.run(["nft", "delete", "table", "ip", TABLE], capture_output=True)
