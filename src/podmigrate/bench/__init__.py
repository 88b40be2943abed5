"""Benchmarks: commands that measure and save figures (never assertions in tests).

``engine``: every mode and transport at several heap sizes, beside Podman's own two paths;
``suite``: N migrations per mode and M cold restarts; ``memory``: the guest memory warm-up.
``report`` turns their results into Markdown and HTML, with ``stats`` (the tests), ``study`` (the
study's figures and tables) and ``plots`` (the PNGs).
"""
