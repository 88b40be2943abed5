"""The local lab: nodes as namespaces on one Linux machine, a LAN bridge, an OCI registry.

``image`` builds the node image, ``cluster`` is the ``Lab`` handle (state, agents, exec, status),
``lifecycle`` starts and stops a lab from the host, ``host`` has its cgroup and process helpers,
``preflight`` checks the machine first, and ``init`` is what runs inside the lab (stdlib only).
Nothing here imports ``podmigrate.workload``: the workload builds its image on a lab, not the reverse.
"""
