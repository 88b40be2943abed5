"""Upstream's kubelet on a lab node: its configuration for a node of this lab, and what it needs of
the node that the lab's machine would otherwise give by changing machine-wide state.

- cgroup2 without cpu/memory/pids controllers (the host's v1 hierarchies own them): no QoS cgroups,
  no node-allocatable enforcement, the cgroupfs driver; containerd's runc wrapper drops the limits.
- At start the kubelet sets six kernel settings (``vm.overcommit_memory``, ``vm.panic_on_oom``,
  ``kernel.panic``, ``kernel.panic_on_oops``, ``kernel.keys.root_maxkeys`` and ``root_maxbytes``) to
  its defaults when they differ, and fails if it cannot. They are machine-wide (the nodes share the
  host's kernel), so the node's own mount namespace shows it files holding the values it expects,
  bound over ``/proc/sys``: it finds nothing to change, and the machine keeps its settings.
- It runs in the node's namespaces and cgroup, speaks CRI to the node's containerd, authenticates
  to the API server as ``system:node:<node>`` (the Node authorizer and NodeRestriction know it by
  that), serves its API (the Checkpoint API among it, ``ContainerCheckpoint``) with a certificate of
  the cluster's CA and asks the API server about every caller (webhook authentication and
  authorization: a SubjectAccessReview for ``nodes/checkpoint``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from podmigrate import layout
from podmigrate.kube.certs import Paths
from podmigrate.lab import containerd

# the kubelet's defaults (pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables)
KERNEL_DEFAULTS = {
    "vm/overcommit_memory": 1,
    "vm/panic_on_oom": 0,
    "kernel/panic": 10,
    "kernel/panic_on_oops": 1,
    "kernel/keys/root_maxkeys": 1000000,
    "kernel/keys/root_maxbytes": 25000000,
}
PORT = 10250


PLEGS = ("generic", "evented")  # the kubelet's relist every second, or the runtime's CRI events


def config(paths: Paths, node: str, pleg: str = "generic") -> dict[str, Any]:
    pki = f"{paths.lab}/pki"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": layout.node_ip(node),
        "port": PORT,
        "readOnlyPort": 0,
        "tlsCertFile": f"{pki}/kubelet-{node}.crt",
        "tlsPrivateKeyFile": f"{pki}/kubelet-{node}.key",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": f"{pki}/ca.crt"},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{containerd.socket_path(node)}",
        "featureGates": {"ContainerCheckpoint": True, "EventedPLEG": pleg == "evented"},
        "protectKernelDefaults": False,
        "localStorageCapacityIsolation": False,
        "evictionHard": {"memory.available": "100Mi"},  # no disk thresholds: the lab's nodes share one disk
        "resolvConf": "",
        "clusterDomain": "cluster.local",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }


def write_config(paths: Paths, node: str, pleg: str = "generic") -> Path:
    d = paths.host / "nodes" / node
    d.mkdir(parents=True, exist_ok=True)
    path = d / "kubelet.json"
    path.write_text(json.dumps(config(paths, node, pleg), indent=2) + "\n")
    return path


def shadow_script() -> str:
    """Shell run in the node's mount namespace: each setting of ``KERNEL_DEFAULTS`` shown to the
    node as a file with the kubelet's value, bound over its /proc/sys path (idempotent)."""
    lines = ["set -e", "mkdir -p /run/podmigrate-kubelet-sysctl"]
    for key, value in KERNEL_DEFAULTS.items():
        f = f"/run/podmigrate-kubelet-sysctl/{key.replace('/', '.')}"
        lines.append(f"mountpoint -q /proc/sys/{key} || {{ echo {value} > {f}; mount --bind {f} /proc/sys/{key}; }}")
    return "\n".join(lines) + "\n"


def argv(paths: Paths, node: str, kubeconfig: Path) -> list[str]:
    return [
        f"{paths.lab}/bin/kubelet",
        "--config",
        paths.inside(paths.host / "nodes" / node / "kubelet.json"),
        "--kubeconfig",
        paths.inside(kubeconfig),
        "--hostname-override",
        node,
        "--node-ip",
        layout.node_ip(node),
        "--v=1",
    ]


def conflist(pod_cidr: str) -> str:
    """The node's pod network: a bridge with the node as the pods' gateway, addresses from its
    podCIDR, no NAT (the LAN routes each node's podCIDR to it, as it routes the workloads' ranges)."""
    bridge = {
        "type": "bridge",
        "bridge": "cni0",
        "isGateway": True,
        "ipMasq": False,
        "hairpinMode": True,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]},
    }
    return json.dumps({"cniVersion": "1.0.0", "name": "pods", "plugins": [bridge]}, indent=2) + "\n"


def proxy_config(paths: Paths, node: str, kubeconfig: Path) -> str:
    """kube-proxy on ``node``: nftables mode (in the node's own network namespace), and every
    conntrack setting 0, which tells it to leave the kernel's (machine-wide) values as they are."""
    conf = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": paths.inside(kubeconfig)},
        "mode": "nftables",
        "clusterCIDR": layout.POD_SUBNET,
        "hostnameOverride": node,
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
        "metricsBindAddress": "127.0.0.1:10249",
        "healthzBindAddress": "0.0.0.0:10256",  # upstream's default: the operator asks it whether it followed
    }
    path = paths.host / "nodes" / node / "kube-proxy.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conf, indent=2) + "\n")
    return paths.inside(path)
