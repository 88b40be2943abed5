"""Runtime backends: what a node agent drives to run, checkpoint and restore containers.

``base`` holds the interface (``Runtime``, ``NodeCapabilities``); ``podman`` is the lab's backend
(Podman + runc + CRIU), one class joined from its siblings ``podman_cli``, ``podman_containers``,
``podman_pod``, ``lazy`` and ``criu_conf``, with ``freezer`` and ``uffd`` as its helpers against the
kernel. The Kubernetes agent (``k8s.agent``) checkpoints through the kubelet's API instead, not this interface.
Standard library only.
"""
