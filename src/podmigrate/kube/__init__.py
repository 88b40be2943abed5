"""Upstream Kubernetes in the lab: the control plane and the kubelets built from the ``k8s.io/kubernetes``
Go module at one pinned release (``kube.build``), run on the lab's containerd nodes.

Unlike ``kubelab`` (kmock's emulated API server and podmigrate's own CRI kubelet), every component
here is upstream's.
"""
