"""The node agent: an authenticated HTTP API over a runtime backend, a transport and a router.

One process per lab node (role ``node``) and one on the LAN (role ``lan``: router, prober, HTTP
reads of service addresses). On Kubernetes the same agent runs as a DaemonSet. Standard library only.
"""
