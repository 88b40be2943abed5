"""Transports: how checkpoint bytes move from the source node to the target node.

``registry`` packages a checkpoint as an OCI image (the format CRI-O restores from) and moves it
through an OCI registry; it runs inside node agents (standard library only).
"""
