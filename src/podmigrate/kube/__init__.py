"""Upstream Kubernetes in the lab: the control plane and the kubelets built from the ``k8s.io/kubernetes``
Go module at one pinned release (``kube.build``), run on the lab's containerd nodes; podmigrate
installed on it as a user installs it (``kube.install``), and a client probing it from outside
(``kube.prober``).
"""
