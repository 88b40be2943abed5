"""A client for the Kubernetes Container Runtime Interface (CRI v1), over a runtime's Unix socket.

Role: what a kubelet says to its container runtime (containerd 2.1's CRI plugin in the lab), typed
and with errors that say what to do: ``client.CRIClient``. The messages are the generated
``api_pb2`` (from ``api.proto``, CRI v0.32.3 as containerd 2.1.9 vendors it; ``scripts/gen-cri``
makes ``api_pb2*.py`` and their ``.pyi``; ``tests/test_cri.py`` keeps them equal to the proto).

Neighbours: the Kubernetes side uses it (the test kubelet, the Kubernetes node agent), beside
``runtime.podman``, the Podman backend of the lab's own agents. It needs grpcio and protobuf (the
``k8s`` extra), so it runs on the host only: nothing that runs inside the lab imports it (the
lab's nodes have a standard-library python3; an import-linter contract in pyproject.toml checks
it). Failures are ``errors.CRIError``.
"""

from podmigrate.cri.client import CRIClient

__all__ = ["CRIClient"]
