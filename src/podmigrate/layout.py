"""Names, addresses and paths of a lab, shared by the host side and the code inside the lab.

Standard library only. The lab is a LAN bridge in a ``lan`` network namespace plus one namespace
set per node; the numbers here are the whole address plan, so nothing has to be discovered twice.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import string

LAN_BRIDGE = "br0"
LAN_GATEWAY = "10.77.0.1"
LAN_PREFIX = 24
REGISTRY = f"{LAN_GATEWAY}:5000"
AGENT_PORT = 7070
CONTROLLER = "podmigrate-controller"  # the certificate name agents let call every route over TCP (hosts, lab)
# Every node has a podman network of this name with the same subnet, so a restored container keeps its
# address on any node; each node hands out addresses from its own /24 inside it, so two nodes never
# give the same address to two containers.
WORKLOAD_NETWORK = "mig"
WORKLOAD_SUBNET = "10.89.0.0/16"
WORKLOAD_GATEWAY = "10.89.0.1"
# Pods of the lab's upstream Kubernetes (podmigrate.kube): each node gets a /24 of it (its podCIDR);
# the nodes' guard treats them as workloads too
POD_SUBNET = "10.244.0.0/16"
MAX_NODES = 20

# Paths as seen inside the lab (after pivot_root into the node image).
IN_LAB_STATE = "/var/lib/podmigrate-lab"  # the lab's host state directory, bind-mounted
IN_LAB_CACHE = "/var/lib/podmigrate-cache"  # the host image cache, bind-mounted
IN_LAB_SRC = "/opt/podmigrate"  # PYTHONPATH: holds the podmigrate package
NODE_CHECKPOINTS = "/var/lib/podmigrate/checkpoints"  # node-private (bind from the node's state dir)
NODE_NOTICE = "/var/tmp/podmigrate-instance-action.json"  # a Spot notice (agent.notice); /var/tmp is the node's
LAB_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def node_names(count: int) -> list[str]:
    if not 1 <= count <= MAX_NODES:
        raise ValueError(f"a lab has 1 to {MAX_NODES} nodes, not {count}")
    return [f"node-{c}" for c in string.ascii_lowercase[:count]]


def node_index(name: str) -> int:
    """node-a -> 1, node-b -> 2, ... (0 is never a node)."""
    if not (name.startswith("node-") and len(name) == 6 and name[5] in string.ascii_lowercase):
        raise ValueError(f"not a node name: {name!r}")
    return string.ascii_lowercase.index(name[5]) + 1


def node_ip(name: str) -> str:
    return f"10.77.0.{10 + node_index(name)}"


def node_range(name: str) -> str:
    """The /24 inside WORKLOAD_SUBNET from which node ``name`` allocates container addresses."""
    return f"10.89.{node_index(name)}.0/24"


def in_workload_subnet(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(WORKLOAD_SUBNET)
    except ValueError:
        return False


def cgroup_name(lab: str, home: str) -> str:
    """The lab's cgroup2 subtree: named from its home as well as its name, since two users (two
    PODMIGRATE_HOMEs) may each have a lab of the same name, and ``lab up`` clears what its cgroup holds."""
    digest = hashlib.sha256(os.path.realpath(home).encode()).hexdigest()[:8]
    return f"podmigrate-{lab}-{digest}"
