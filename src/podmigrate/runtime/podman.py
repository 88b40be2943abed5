"""The Podman + runc + CRIU backend of the node agent: ``Podman``, the ``base.Runtime`` the lab's agents drive.

It joins its siblings, each one seam of the backend: ``podman_cli`` (one podman command, failures
explained), ``podman_containers`` (container verbs), ``podman_pod`` (whole pods), ``lazy`` (page
server and post-copy), ``criu_conf`` (CRIU's options file and output); it adds what the node reports
about itself (``info``). Standard library only.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from podmigrate.runtime.lazy import PodmanLazy
from podmigrate.runtime.podman_containers import PodmanContainers
from podmigrate.runtime.podman_pod import PodmanPods


class Podman(PodmanPods, PodmanLazy, PodmanContainers):
    def info(self) -> dict[str, Any]:
        def first_line(*cmd: str) -> str:
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            except OSError:
                return "missing"
            return out.strip().splitlines()[0] if out.strip() else "unknown"

        criu = first_line("criu", "--version")
        return {
            "runtime": "podman",
            "podman": first_line("podman", "--version").split()[-1],
            "runc": first_line("runc", "--version").split()[-1],
            "criu": criu.split()[-1] if criu.startswith("Version") else criu,
            "lazy_pages": os.path.exists("/proc/sys/vm/unprivileged_userfaultfd"),
            "soft_dirty": False,
        }
