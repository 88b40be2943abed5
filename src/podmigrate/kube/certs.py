"""The cluster's identities: its CA (``<lab>/kube/pki``), a certificate per component with the user and
groups upstream's authorizers expect (CN and O), the service-account signing key, and a kubeconfig
per client. Paths are written as the lab sees them (``/var/lib/podmigrate-lab/...``: the control
plane runs inside the lab) except the admin's host copy, which ``kube kubectl`` uses from the host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from podmigrate import layout
from podmigrate.pki import CA, Identity

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: the API server's certificate names it
CLUSTER_CIDR = layout.POD_SUBNET  # pod addresses; each node gets a /24 of it
API_PORT = 6443
API_SERVER = f"https://{layout.LAN_GATEWAY}:{API_PORT}"
# (file, CN = user, O = groups): the names upstream's RBAC bootstrap policy binds
CLIENTS = {
    "admin": ("kubernetes-admin", ("system:masters",)),
    "kube-controller-manager": ("system:kube-controller-manager", ()),
    "kube-scheduler": ("system:kube-scheduler", ()),
    "kube-proxy": ("system:kube-proxy", ()),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ("system:masters",)),
    "apiserver-etcd-client": ("kube-apiserver-etcd-client", ()),
}


@dataclass(frozen=True)
class Paths:
    """Where a lab's cluster keeps its files: on the host (``host``) and inside the lab (``lab``)."""

    host: Path

    @property
    def lab(self) -> Path:
        return Path(layout.IN_LAB_STATE) / "kube"

    def inside(self, path: Path) -> str:
        """``path`` (under ``host``) as the lab sees it."""
        return str(self.lab / path.relative_to(self.host))


def issue(paths: Paths, nodes: list[str]) -> CA:
    """Every identity of the cluster, made if missing (restarting a cluster keeps them)."""
    ca = CA(paths.host / "pki", "kubernetes")
    ca.issue(
        "kube-apiserver",
        ips=[layout.LAN_GATEWAY, SERVICE_IP, "127.0.0.1"],
        dns=["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
             "localhost"],
    )  # fmt: skip
    ca.issue("etcd", ips=["127.0.0.1"], dns=["localhost"])
    for component in ("kube-controller-manager", "kube-scheduler"):  # their /healthz, checked against the CA
        ca.issue(component, ips=["127.0.0.1"], dns=["localhost"], file=f"{component}-serving")
    ca.issue("front-proxy-client")  # the API server's aggregation layer: requests it proxies say who asked
    for file, (user, groups) in CLIENTS.items():
        ca.issue(user, orgs=groups, file=file)
    for n in nodes:  # the Node authorizer knows a kubelet by this name and group
        ca.issue(f"system:node:{n}", ips=[layout.node_ip(n)], dns=[n], orgs=["system:nodes"], file=f"kubelet-{n}")
    sa = paths.host / "pki" / "sa.key"
    if not sa.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
        sa.touch(mode=0o600)
        sa.write_bytes(pem)
        pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        (paths.host / "pki" / "sa.pub").write_bytes(pub)
    return ca


def identity(paths: Paths, file: str) -> Identity:
    pki = paths.host / "pki"
    return Identity(file, pki / f"{file}.crt", pki / f"{file}.key", pki / "ca.crt")


def kubeconfig(paths: Paths, file: str, user: str, server: str = API_SERVER, inside: bool = True) -> Path:
    """A kubeconfig for ``file``'s certificate (JSON, which kubeconfig readers take as YAML)."""
    ident = identity(paths, file)
    where = paths.inside if inside else str
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "lab", "cluster": {"server": server, "certificate-authority": where(ident.ca)}}],
        "users": [{"name": user, "user": {"client-certificate": where(ident.cert), "client-key": where(ident.key)}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": user}}],
        "current-context": "lab",
    }
    out = paths.host / f"{file}{'' if inside else '.host'}.kubeconfig"
    out.touch(mode=0o600)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out
