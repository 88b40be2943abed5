"""A Kubernetes cluster on the lab's containerd nodes, for tests, ``demo --kubernetes`` and the bench.

Everything under the API server is real: each node's containerd and CRIU, a kubelet per node that
drives that containerd over CRI (``kubelab.kubelet``), the registry, the node agents and the operator
(kopf, in its own process). The API server is the one thing that cannot run here: kmock's emulator
stands in for it (``kubelab.apiserver``). The control plane sits on the lab's LAN (``kubelab.netns``):
it reaches the nodes, the registry and the pods at their lab addresses, like a cluster's control plane.
"""
