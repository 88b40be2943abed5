"""Kubernetes integration: the PodLiveMigration CRD, the kopf operator and the node agent (DaemonSet).

- ``crd``: the resource's schema (the one source of the CRD manifest) and spec validation;
- ``api``: a small Kubernetes REST client (in-cluster config or kubeconfig), merge-patch only;
- ``kubelet``: the Kubelet Checkpoint API client (KEP-2008);
- ``agent``: the node agent: kubelet checkpoint -> OCI checkpoint image -> registry, archive cleanup;
- ``controller``: one migration as ordered phases with rollbacks, its record kept in the resource's
  status (the lab controller's design, with Kubernetes backends);
- ``operator``: kopf handlers, Events and Prometheus metrics around ``controller``.
"""
