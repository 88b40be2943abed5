"""Helpers for the tests that need a TLS endpoint on loopback (``test_registry_auth``).

The Kubernetes tests run on real kubelets over containerd (``podmigrate.kubelab``); only the API
server is emulated there, and it lives in the package (``podmigrate.kubelab.apiserver``).
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
