"""What the tests that need a TLS endpoint on loopback use (``test_registry_auth``): the Kubernetes
lab's own helpers (``podmigrate.kubelab.cluster``)."""

from __future__ import annotations

from pathlib import Path

from podmigrate.kubelab.cluster import free_port, self_signed

__all__ = ["free_port", "self_signed_cert"]


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    return self_signed(directory, "127.0.0.1")
