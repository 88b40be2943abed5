"""The local lab: nodes as namespaces on one Linux machine, a LAN bridge, an OCI registry.

``image`` builds the node image, ``cluster`` starts, inspects and stops a lab from the host,
``preflight`` checks the machine first, and ``init`` is what runs inside the lab (stdlib only).
"""
