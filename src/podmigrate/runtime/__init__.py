"""Runtime backends: what a node agent drives to run, checkpoint and restore containers.

``base`` holds the interface; ``podman`` is the lab's backend (Podman + runc + CRIU). The Kubernetes
backend (kubelet checkpoint API + CRI-O) implements the same interface. Standard library only.
"""
