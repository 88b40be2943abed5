"""The Secrets the manifests mount, made without cert-manager: the agents' CA, the agent's and the
operator's certificates (``podmigrate.pki``: CN podmigrate-agent and podmigrate-operator, both server
and client), and the master key the operator derives each migration's sealing key from.

``podmigrate k8s secrets --dir DIR | kubectl apply -f -``: ``DIR`` keeps the CA and the key (0600), so
running it again gives the same CA and key and a cluster's migrations stay readable. That CA must
sign nothing but podmigrate's agents and operator: the operator accepts any agent certificate it
signed (agents are dialled at pod addresses no certificate names).
"""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path
from typing import Any

from podmigrate.pki import CA

NAMESPACE = "podmigrate-system"
TLS = {"podmigrate-agent-tls": "podmigrate-agent", "podmigrate-operator-tls": "podmigrate-operator"}
SEAL = "podmigrate-seal-key"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def seal_key(directory: Path) -> str:
    """The master sealing key kept in ``directory`` (made once, 64 hex, 0600)."""
    path = directory / "seal.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip()


def manifests(directory: Path, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The three Secrets, as objects for ``kubectl apply``."""
    ca = CA(directory, "agents")
    out: list[dict[str, Any]] = []
    for secret, name in TLS.items():
        # the operator's also serves the eviction webhook (webhook.yaml) at its Service's name
        dns = [f"podmigrate-webhook.{namespace}.svc"] if name == "podmigrate-operator" else []
        ident = ca.issue(name, dns=dns, file=f"{name}.{namespace}" if dns else name)
        data = {"tls.crt": ident.cert.read_bytes(), "tls.key": ident.key.read_bytes()}
        data["ca.crt"] = ca.cert_path.read_bytes()
        out.append({
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": secret, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "podmigrate"}},
            "data": {k: _b64(v) for k, v in data.items()},
        })  # fmt: skip
    out.append({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": SEAL, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "podmigrate"}},
        "data": {"key": _b64(seal_key(directory).encode())},
    })  # fmt: skip
    return out
