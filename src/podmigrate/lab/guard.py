"""The nftables guard on each lab node (``lab.init`` applies it when it builds the LAN): what runs as a
workload, a podman container or a pod of the lab's Kubernetes, cannot open connections into the lab
itself. Standard library only (it runs inside the lab).
"""

from __future__ import annotations

import subprocess

from podmigrate import layout

GUARD = """\
table inet podmigrate_guard {{
  chain input {{
    type filter hook input priority -10; policy accept;
    ip saddr {workloads} tcp flags & (syn | ack) == syn drop
    ip saddr {workloads} meta l4proto udp drop
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    ip saddr {workloads} ip daddr {lan} tcp flags & (syn | ack) == syn drop
    ip saddr {workloads} ip daddr {lan} meta l4proto udp drop
  }}
}}
"""


def rules() -> str:
    """The guard's nftables table: workloads are the podman containers' range and the pods'."""
    workloads = f"{{ {layout.WORKLOAD_SUBNET}, {layout.POD_SUBNET} }}"
    return GUARD.format(workloads=workloads, lan=f"{layout.LAN_GATEWAY}/{layout.LAN_PREFIX}")


def apply(name: str, env: dict[str, str]) -> None:
    """Workloads cannot open connections to their node (its agent, page servers, lazy-pages dumps)
    nor to anything on the LAN's own subnet (other nodes, the LAN agent, the registry). Only
    connection openings are dropped, not packets of connections: a restored container's TCP
    connections arrive mid-stream on a node that never saw them open."""
    p = subprocess.run(
        ["nsenter", f"--net=/run/netns/{name}", "nft", "-f", "-"],
        input=rules(),
        capture_output=True,
        text=True,
        env=env,
    )
    if p.returncode:
        raise RuntimeError(f"nft guard on {name} failed: {p.stderr.strip()}")
