"""Benchmarks: commands that measure and save figures (never assertions in tests).

``engine``: every mode and transport at several heap sizes, beside Podman's own two paths.
"""
