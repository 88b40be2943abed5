"""Machines that are not the lab: an inventory of hosts running Podman and podmigrate's node agent.

``inventory`` reads and checks the inventory (TOML); ``identities`` makes a CA and a certificate per
host and for the controller, and for each host the bundle its agent runs from (``podmigrate hosts
init``); ``agent_unit`` installs that agent as a systemd service on a host, from the package.
"""
