"""The node agent: an authenticated HTTP API over a runtime backend, a transport and a router.

One process per lab node (role ``node``) and one on the LAN (role ``lan``: router, prober, HTTP
reads of service addresses). On Kubernetes the same agent runs as a DaemonSet. Standard library only.
``server`` starts it; ``http`` is the route table, auth and errors; ``node`` (with ``node_lazy``,
``memory``, ``checkpoints``) and ``lan`` are the two roles' routes; ``probe`` the LAN's probers.
"""
