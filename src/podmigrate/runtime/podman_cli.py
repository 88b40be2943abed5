"""The base of the Podman backend: one ``podman`` command on this node, and its failure explained.

Every CRIU failure is reported with the tail of CRIU's log (``criu_conf``), which podman only names.
``podman_containers``, ``podman_pod`` and ``lazy`` build on it; ``podman.Podman`` joins them.
Standard library only.
"""

from __future__ import annotations

import subprocess
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from podmigrate.errors import RuntimeBackendError, UsageError
from podmigrate.runtime import criu_conf
from podmigrate.runtime.base import ContainerInfo

CHECKPOINTING = "checkpointing"  # the state listed for a container in a lazy dump (``dumping``)


class PodmanCLI:
    def __init__(self, node: str):
        self.node = node
        # containers in a lazy dump, by ID: their podman checkpoint holds the container's lock until
        # the last page has moved, so podman's ps and inspect would wait for it; listed from here
        self.dumping: dict[str, tuple[subprocess.Popen[str], ContainerInfo]] = {}

    def criu_options(
        self, *lines: str, run: criu_conf.CriuRun | None = None, container_id: str | None = None
    ) -> AbstractContextManager[Path]:
        """Extra CRIU options for the podman commands run inside the block; the file their CRIU opens
        as its configuration (see ``criu_conf``)."""
        return criu_conf.criu_options(*lines, run=run, container_id=container_id)

    def _run(
        self, *args: str, timeout: float = 900, what: str | None = None, missing_ok: bool = False
    ) -> subprocess.CompletedProcess[str]:
        env = criu_conf.block_env()  # a CRIU run's own options, inside a criu_options block
        p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode:
            err = p.stderr.strip() or p.stdout.strip()
            if missing_ok and ("no such container" in err or "no such pod" in err):
                return p
            if "no such container" in err:
                raise UsageError(
                    f"there is no container {args[-1]!r} on {self.node}",
                    hint=f"list them with: podmigrate lab exec {self.node} -- podman ps -a",
                )
            raise RuntimeBackendError(
                f"{what or 'podman ' + args[0]} failed on {self.node}: {err.splitlines()[-1] if err else p.returncode}",
                hint="the CRIU log lines are in details.criu_log" if criu_conf.CRIU_LOG.search(err) else None,
                details={
                    "command": ["podman", *args],
                    "returncode": p.returncode,
                    "stderr": err[-4000:],
                    "criu_log": criu_conf.criu_log_tail(err),
                    "node": self.node,
                },
            )
        return p


def container_info(d: dict[str, Any], state: str | None = None) -> ContainerInfo:
    """A container as podman's inspect describes it (``state``: instead of podman's)."""
    nets = (d.get("NetworkSettings") or {}).get("Networks") or {}
    cfg = d.get("Config") or {}
    return ContainerInfo(
        name=d["Name"],
        id=d["Id"],
        state=state or d["State"]["Status"],
        image=d.get("ImageName") or cfg.get("Image", ""),
        image_id=d.get("Image", ""),
        ips=[n["IPAddress"] for n in nets.values() if n.get("IPAddress")],
        pod=d.get("Pod") or None,
        labels=cfg.get("Labels") or {},
    )


RESTORE_NETWORK = {
    "keep": [],  # the source's address and MAC (a network whose addresses the router moves)
    # the same address, a new MAC: on a segment every host shares, nothing reaches the copy before
    # it announces itself (the source's MAC would be learnt at its port as soon as it sent a frame)
    "keep-ip": ["--ignore-static-mac"],
    "new": ["--ignore-static-ip", "--ignore-static-mac"],  # one of its new host's network (router none)
}


def restore_network(network: str) -> list[str]:
    """podman restore's options for the copy's address. Without them Podman reuses the checkpoint's
    address and MAC, even for a container that never asked for a static one."""
    if network not in RESTORE_NETWORK:
        raise UsageError(f"no restore network {network!r}", hint=f"one of: {', '.join(RESTORE_NETWORK)}")
    return RESTORE_NETWORK[network]
