"""Routers: how traffic for a workload's service address is switched from one node to another.

``route`` (the lab default) switches a /32 host route in the LAN namespace with one netlink call.
Routers run inside the LAN agent (standard library only).
"""
