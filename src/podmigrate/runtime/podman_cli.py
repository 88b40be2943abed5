"""The base of the Podman backend: one ``podman`` command on this node, and its failure explained.

Every CRIU failure is reported with the tail of CRIU's log (``criu_conf``), which podman only names.
``podman_containers``, ``podman_pod`` and ``lazy`` build on it; ``podman.Podman`` joins them.
Standard library only.
"""

from __future__ import annotations

import subprocess
from contextlib import AbstractContextManager

from podmigrate.errors import RuntimeBackendError, UsageError
from podmigrate.runtime import criu_conf


class PodmanCLI:
    def __init__(self, node: str):
        self.node = node

    def criu_options(self, *lines: str) -> AbstractContextManager[None]:
        """Extra CRIU options for the podman commands run inside the block (see ``criu_conf``)."""
        return criu_conf.criu_options(*lines)

    def _run(
        self, *args: str, timeout: float = 900, what: str | None = None, missing_ok: bool = False
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
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
