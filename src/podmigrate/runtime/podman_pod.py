"""Whole pods in the Podman backend: create one, describe it, lock its network, dump and restore its members.

The members are dumped and restored one after the other with the container verbs of
``podman_containers``, under one network lock; ``podman.Podman`` joins this with ``lazy``. Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from podmigrate.errors import RuntimeBackendError
from podmigrate.runtime.base import RunSpec
from podmigrate.runtime.criu_conf import parse_stats
from podmigrate.runtime.podman_containers import PodmanContainers


class PodmanPods(PodmanContainers):
    def create_pod(self, name: str, network: str, ip: str | None = None, mac: str | None = None) -> None:
        args = ["pod", "create", "--name", name, "--network", network]
        if ip:
            args += ["--ip", ip]
        if mac:  # the same MAC too: the node's bridge may still hold the old one in its neighbour cache
            args += ["--mac-address", mac]
        self._run(*args, what=f"creating pod {name}")

    def pod_info(self, pod: str) -> dict[str, Any]:
        data = json.loads(self._run("pod", "inspect", "--", pod).stdout)
        data = data[0] if isinstance(data, list) else data
        infra = data.get("InfraContainerID", "")
        members = [c["Name"] for c in data.get("Containers", []) if c["Id"] != infra]
        nets = json.loads(self._run("inspect", "-f", "{{json .NetworkSettings.Networks}}", "--", infra).stdout or "{}")
        macs = [n["MacAddress"] for n in nets.values() if n.get("MacAddress")]
        return {"name": data["Name"], "infra": infra, "members": sorted(members), "mac": macs[0] if macs else None}

    def pod_lock(self, pod: str, on: bool) -> None:
        """Drop (or stop dropping) every packet in the pod's network namespace, loopback included.

        Containers of a pod are dumped and restored one after the other; a packet reaching one
        already dumped, or not yet restored, would be answered with a RST and break the loopback
        connections between them (the study's sidecar finding). The lock closes that window."""
        pid = self._run("inspect", "-f", "{{.State.Pid}}", "--", self.pod_info(pod)["infra"]).stdout.strip()
        for chain in ("INPUT", "OUTPUT"):
            rule = [chain, *(["1"] if on else []), "-m", "comment", "--comment", "podmigrate-pod-lock", "-j", "DROP"]
            p = subprocess.run(
                ["nsenter", "-t", pid, "-n", "iptables", "-I" if on else "-D", *rule], capture_output=True, text=True
            )
            if on and p.returncode:
                raise RuntimeBackendError(f"locking the network of pod {pod} on {self.node} failed: {p.stderr}")

    def checkpoint_pod(
        self, pod: str, archives: dict[str, Path], *, tcp_established: bool = True, leave_running: bool = False
    ) -> dict[str, Any]:
        """Dump every container of ``pod`` under one network lock. A stopped source pod stays locked:
        it is removed once the copy serves, or restored in place (and unlocked) on rollback. With
        ``leave_running`` (decoupled) the members run on and the lock goes once all are dumped: the
        dumps are of one moment, and the pod serves again right after."""
        t0 = time.time()
        self.pod_lock(pod, True)
        try:
            stats = {
                name: self.checkpoint(name, archive, tcp_established=tcp_established, leave_running=leave_running)
                for name, archive in archives.items()
            }
        finally:
            if leave_running:
                self.pod_lock(pod, False)
        return {"started": t0, "ended": time.time(), "members": stats}

    def restore_pod_in_place(self, pod: str, members: list[str], *, tcp_established: bool = True) -> dict[str, Any]:
        done = []
        for name in members:  # still under the lock checkpoint_pod set
            state = self._run("inspect", "-f", "{{.State.Status}}", "--", name).stdout.strip()
            if state != "running":
                self.restore_local(name, tcp_established=tcp_established)
                done.append(name)
        self.pod_lock(pod, False)
        return {"restored": done}

    def restore_pod(
        self,
        pod: str,
        network: str,
        ip: str,
        archives: dict[str, Path],
        *,
        mac: str | None = None,
        tcp_established: bool = True,
        fresh: list[RunSpec] | None = None,
    ) -> dict[str, Any]:
        """Create the pod with the same address, start its infra, and restore the members into it under
        one network lock, so that neither end of a loopback connection sees the other missing. Members
        in ``fresh`` (not checkpointed) start afresh from their specs afterwards."""
        t0 = time.time()
        self.create_pod(pod, network, ip, mac)
        self._run("pod", "start", "--", pod, what=f"starting pod {pod}")
        stats = {}
        self.pod_lock(pod, True)
        try:
            for name, archive in archives.items():
                args = ["container", "restore", "--import", str(archive), "--pod", pod, "--print-stats"]
                if tcp_established:
                    args.append("--tcp-established")
                with self.criu_options():
                    stats[name] = parse_stats(self._run(*args, what=f"restore of {name} into pod {pod}").stdout)
        finally:
            self.pod_lock(pod, False)
        for spec in fresh or []:
            self.run({**spec, "pod": pod})
        return {"started": t0, "ended": time.time(), "members": stats, "fresh": [f["name"] for f in fresh or []]}
