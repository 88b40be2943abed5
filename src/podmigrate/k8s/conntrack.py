"""A moved pod's old address forgotten by every node's connection tracking.

kube-proxy sends a Service's new connections through NAT, and the kernel remembers each mapping
(conntrack) until the connection ends. A client's SYN that got no answer (the source frozen for its
dump, its network locked) leaves an entry in ``SYN_SENT`` for 120 s, mapped to the source's address.
A client reuses source ports: a later SYN from the same port to the same node matches that entry,
counts as a retransmission, keeps the old mapping and goes to an address no pod has any more; each
such probe waits out its timeout, and refreshes the entry. Measured in the lab: 41 entries
``[UNREPLIED]`` to departed pods on one node after 30 decoupled runs; the prober's ports come round in
about a minute at 50 Hz, and 2-4 runs in 10 lost a probe near the cutover. kube-proxy deletes such
entries for UDP only. Once the source is gone the operator asks each node's agent to delete the TCP
entries whose reply comes from its address (``conntrack -D``); a new SYN from that port then takes
the Service's current rules. Route::

    POST /v1/conntrack/forget   {addresses: [ip]} -> {deleted: {ip: n}} | {skipped: why}
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
from typing import Any

from podmigrate.agent.http import App
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.k8s import api as k
from podmigrate.k8s.context import Ctx

_DELETED = re.compile(r"(\d+) flow entries have been deleted")


def routes(app: App) -> None:
    app.route("POST", "/v1/conntrack/forget")(lambda p, b: forget(b))


def forget(b: dict[str, Any]) -> dict[str, Any]:
    try:
        addresses = [str(ipaddress.ip_address(str(a))) for a in b.get("addresses") or []]
    except ValueError:
        raise UsageError(f"not pod addresses: {b.get('addresses')!r}") from None
    tool = shutil.which("conntrack")
    if tool is None:  # an image without conntrack-tools: the entries time out on their own
        return {"skipped": "no conntrack tool in the agent's image"}
    deleted: dict[str, int] = {}
    for ip in addresses:
        p = subprocess.run([tool, "-D", "-p", "tcp", "--reply-src", ip], capture_output=True, text=True, timeout=30)
        if m := _DELETED.search(p.stderr + p.stdout):
            deleted[ip] = int(m.group(1))
        elif p.returncode != 0:  # not permitted (an agent without NET_ADMIN), or no conntrack in the kernel
            return {"skipped": (p.stderr.strip() or f"conntrack exited {p.returncode}")[-200:]}
    return {"deleted": deleted}


def forget_source(ctx: Ctx, ip: str) -> dict[str, Any]:
    """Every node's entries mapped to the source's ``ip`` deleted (cleanup, after the source pod is
    deleted); per node what was done. An agent that cannot is recorded, not a warning: the entries
    then expire on their own (120 s)."""
    done: dict[str, Any] = {}
    if not ip:
        return done
    for node in ctx.api.list(k.nodes()):
        name = node["metadata"]["name"]
        try:
            done[name] = ctx.agents.call(name, "/v1/conntrack/forget", {"addresses": [ip]})
        except PodmigrateError as e:
            done[name] = {"skipped": e.message[-200:]}
    return done
