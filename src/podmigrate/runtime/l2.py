"""A container's address on a shared L2 segment moved between hosts (the hosts' ``l2`` router).

Its copy, restored with the same address and MAC (a macvlan or bridged network of the same subnet on
every host), must become the one the segment sends that address to: the source's interface goes
down in its network namespace (``withdraw``: a frozen source's kernel would still answer ARP for it,
and the switch would learn the MAC back to the old port), then the copy's interface sends gratuitous
ARP (``announce``): the neighbours' caches and the switch's table point at the target at once.
Everything runs in the container's network namespace (``nsenter --net``), with ``ip`` and python3.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from podmigrate import names
from podmigrate.errors import RuntimeBackendError
from podmigrate.runtime.podman_containers import PodmanContainers

# Gratuitous ARP, as a request and a reply each three times, from ``argv[1]`` for ``argv[2]``
# (standard library only: it runs in the node's python3 inside the container's network namespace).
GARP = r"""
import fcntl, socket, struct, sys, time
ifname, ip = sys.argv[1], socket.inet_aton(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0806))
s.bind((ifname, 0))
mac = fcntl.ioctl(s.fileno(), 0x8927, struct.pack("256s", ifname.encode()[:15]))[18:24]
for _ in range(3):
    for op, target in ((1, b"\x00" * 6), (2, b"\xff" * 6)):
        arp = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, op, mac, ip, target, ip)
        s.send(b"\xff" * 6 + mac + b"\x08\x06" + arp)
    time.sleep(0.02)
"""


class PodmanL2(PodmanContainers):
    def withdraw(self, address: str) -> dict[str, Any]:
        """Take ``address``'s interface down in each container here holding it; their names. Found by
        their network namespaces, not Podman's view of their state: a source a lazy dump holds
        frozen is not "running" to Podman, and still answers ARP."""
        done = []
        for name, netns, ifname in self._holding(address):
            _nsenter(netns, ["ip", "link", "set", "dev", ifname, "down"])
            done.append(name)
        return {"address": address, "withdrawn": done}

    def announce(self, address: str) -> dict[str, Any]:
        """Bring ``address``'s interface up in the container here holding it and send gratuitous ARP."""
        held = self._holding(address)
        if len(held) != 1:
            raise RuntimeBackendError(
                f"{len(held)} containers here hold {address}, not one: nothing announced",
                details={"containers": [name for name, _, _ in held]},
            )
        name, netns, ifname = held[0]
        _nsenter(netns, ["ip", "link", "set", "dev", ifname, "up"])
        _nsenter(netns, [sys.executable or "python3", "-c", GARP, ifname, address])
        return {"address": address, "container": name, "interface": ifname}

    def _holding(self, address: str) -> list[tuple[str, str, str]]:
        """(container, its network namespace, the interface) for each of this Podman's containers
        whose namespace carries ``address``."""
        names.ipv4(address)
        ids = self._run("ps", "-a", "-q", "--no-trunc").stdout.split()
        fmt = "{{.Name}} {{.NetworkSettings.SandboxKey}}"
        p = subprocess.run(["podman", "inspect", "-f", fmt, *ids], capture_output=True, text=True) if ids else None
        found = []
        for line in (p.stdout if p else "").splitlines():
            name, _, netns = line.partition(" ")
            if not netns.startswith("/run/netns/"):
                continue  # no namespace of its own (host network, or none now)
            try:
                links = json.loads(_nsenter(netns, ["ip", "-j", "-4", "addr", "show"]).stdout or "[]")
            except RuntimeBackendError:
                continue  # gone meanwhile
            found += [(name, netns, str(link["ifname"])) for link in links
                      if any(a.get("local") == address for a in link.get("addr_info") or [])]  # fmt: skip
        return found


def _nsenter(netns: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["nsenter", f"--net={netns}", "--", *argv], capture_output=True, text=True, timeout=30)
    if p.returncode:
        raise RuntimeBackendError(f"`{' '.join(argv[:4])}` in {netns} failed: {p.stderr.strip()[-300:]}")
    return p
