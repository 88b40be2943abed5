"""The ``Lab`` handle, on the host: a lab's state, its agents, commands run inside it, its status.

``lifecycle`` brings it up and takes it down (``Lab.up`` and ``Lab.down`` call it), ``host`` has the
cgroup and process helpers, ``image`` the node image.

A lab named NAME keeps all its host-side state in ``$PODMIGRATE_HOME/labs/NAME`` (pid files, agent
sockets, token, logs, node storage, registry data) and all its processes in one cgroup2 subtree,
``podmigrate-NAME``. Everything else (mounts, network namespaces, bridges, routes) lives in the lab's
private mount namespace and disappears with its processes, so ``down`` is: kill the subtree
(cgroup.kill), remove the empty cgroups, remove the state directory. Nothing is recorded about a lab
that cannot be read back from these files and processes.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from podmigrate import filelock, layout, procs
from podmigrate.client import AgentClient, LanClient
from podmigrate.errors import LabError, UsageError
from podmigrate.lab import lifecycle
from podmigrate.lab.host import NAME, Report, cgroup2_root, holder_pid, home, join
from podmigrate.lab.image import NodeImage

__all__ = ["Lab", "Report", "cgroup2_root", "home"]


class AddressPlan:
    """What the engine needs of a lab besides its agents (``engine.cluster.Cluster``): the lab's fixed
    address plan, and its LAN agent as the router of service addresses and the client outside the
    nodes. The lab and the unit tests' fake lab share it."""

    moves_addresses = True  # every workload has its own address on the lab's network
    shared_segment = False  # the LAN reaches it by the router's route, whichever nodes hold it

    registry = layout.REGISTRY
    workload_network = layout.WORKLOAD_NETWORK

    def agent(self, name: str, timeout: float = 900.0) -> AgentClient:
        raise NotImplementedError

    def node_address(self, node: str) -> str:
        return layout.node_ip(node)

    def is_service_address(self, ip: str) -> bool:
        return layout.in_workload_subnet(ip)

    def traffic(self) -> LanClient:
        return LanClient(self.agent("lan"), self.node_address)

    def observer(self) -> LanClient:
        return LanClient(self.agent("lan"), self.node_address)


class Lab(AddressPlan):
    def __init__(self, name: str = "default"):
        if not NAME.fullmatch(name):
            raise UsageError(f"not a valid lab name: {name!r}", hint="use 1-20 of a-z, 0-9 and '-'")
        self.name = name
        self.base = home()
        self.dir = self.base / "labs" / name
        self.image = NodeImage(self.base / "node-image" / "rootfs")
        self.cache = self.base / "cache"

    # ------------------------------------------------------------------ state
    @property
    def cgroup(self) -> Path:
        # the one its lab.json names, if it has one (a lab started before cgroups were named from
        # their home as well keeps its own); else this home's name for it
        try:
            name = str(json.loads((self.dir / "lab.json").read_text())["cgroup"])
        except (OSError, ValueError, KeyError):
            name = layout.cgroup_name(self.name, str(self.base))
        return cgroup2_root() / name

    def config(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.dir / "lab.json").read_text())
        except (OSError, ValueError) as e:
            raise LabError(f"lab {self.name!r} is not up", hint="start it with: podmigrate lab up") from e
        return data

    @property
    def nodes(self) -> list[str]:
        return list(self.config()["nodes"])

    def holder_pid(self) -> int | None:
        """The lab holder's pid if it is alive, in its own mount namespace, and finished starting."""
        return holder_pid(self.dir)

    def is_up(self) -> bool:
        return self.holder_pid() is not None

    def require_up(self) -> None:
        if not self.is_up():
            raise LabError(f"lab {self.name!r} is not up", hint="start it with: podmigrate lab up")

    def token(self) -> str:
        return (self.dir / "token").read_text().strip()

    def agent(self, name: str, timeout: float = 900.0) -> AgentClient:
        self.require_up()
        if name != "lan" and name not in self.nodes:
            raise UsageError(
                f"there is no node {name!r} in lab {self.name!r}", hint=f"its nodes are: {', '.join(self.nodes)}"
            )
        return AgentClient(name, self.dir / "agents" / f"{name}.sock", self.token(), timeout=timeout)

    def node_pid(self, node: str) -> int:
        p = procs.read_pidfile(self.dir / "pids" / f"holder-{node}.pid")
        if p is None:
            raise LabError(f"node {node} of lab {self.name!r} is not running", hint="podmigrate lab status")
        return p.pid

    @property
    def cgroup_path(self) -> str:
        """The lab's cgroup2 path as /proc/PID/cgroup shows it on the host: a process is the lab's if
        it is in there (``procs.kill``'s check)."""
        return "/" + self.cgroup.relative_to(cgroup2_root()).as_posix()

    def service(self, name: str) -> procs.Proc | None:
        """A supervised service of the lab (registry, an agent, containerd-NODE), by its pid file."""
        p = procs.read_pidfile(self.dir / "pids" / f"{name}.pid")
        return p if p is not None and procs.in_cgroup(p.pid, self.cgroup_path) else None

    def kill_service(self, name: str, sig: int) -> procs.Proc:
        """Signal one supervised service of this lab (its supervisor restarts it unless held)."""
        p = self.service(name)
        if p is None or not procs.kill(p, sig, self.cgroup_path):
            raise LabError(f"lab {self.name!r} has no running {name}", hint="podmigrate lab status")
        return p

    # ------------------------------------------------------------------ exec
    def command(self, target: str, argv: Sequence[str]) -> tuple[list[str], Path]:
        """The host argv that runs ``argv`` in ``target`` (lab, lan, or a node), and its cgroup."""
        pid = self.holder_pid()
        if pid is None:
            raise LabError(f"lab {self.name!r} is not up", hint="start it with: podmigrate lab up")
        env = ["env", "-i", f"PATH={layout.LAB_PATH}", "HOME=/root", "LC_ALL=C.UTF-8", "TERM=xterm"]
        if target == "lab":
            return ["nsenter", "-t", str(pid), "-m", "-r", "-w", "--", *env, *argv], self.cgroup / "lab"
        if target == "lan":
            return (
                ["nsenter", "-t", str(pid), "-m", "-r", "-w", "--", "nsenter", "--net=/run/netns/lan", *env, *argv],
                self.cgroup / "lab",
            )
        if target not in self.nodes:
            raise UsageError(
                f"there is no node {target!r} in lab {self.name!r}",
                hint=f"targets are: lab, lan, {', '.join(self.nodes)}",
            )
        return (
            ["nsenter", "-t", str(self.node_pid(target)), "-m", "-n", "-C", "-r", "-w", "--", *env, *argv],
            self.cgroup / target / "init",
        )

    def run(
        self,
        target: str,
        argv: Sequence[str],
        *,
        check: bool = True,
        capture: bool = True,
        timeout: float | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        cmd, cg = self.command(target, argv)
        p = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, input=input, preexec_fn=join(cg))
        if check and p.returncode:
            raise LabError(
                f"`{' '.join(argv)}` failed on {target} (exit {p.returncode})",
                details={"stdout": (p.stdout or "")[-3000:], "stderr": (p.stderr or "")[-3000:]},
            )
        return p

    def exec_interactive(self, target: str, argv: Sequence[str]) -> int:
        cmd, cg = self.command(target, argv)
        return subprocess.call(cmd, preexec_fn=join(cg))

    # ------------------------------------------------------------------ up, down (lifecycle)
    def up(
        self,
        nodes: int = 2,
        report: Report = lambda _m: None,
        router: str | None = None,
        runtime: str = "podman",
        firewall: str = "none",
    ) -> dict[str, Any]:
        """Build the node image if needed and start the lab (idempotent); its status."""
        with self._exclusive():
            return lifecycle.up(self, nodes, report, router, runtime, firewall)

    def down(self, report: Report = lambda _m: None) -> None:
        """Stop every process of the lab and remove everything it created."""
        with self._exclusive():
            lifecycle.down(self, report)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One ``up`` or ``down`` of this lab at a time: two at once (two commands, two test runs
        of one name) would each take the other's half-made lab for leftovers and remove it."""
        with filelock.held(self.base / "labs" / f".{self.name}.lock"):
            yield

    # ------------------------------------------------------------------ router
    def router(self) -> dict[str, Any]:
        """The LAN's router (``route`` or ``nft``) and the service addresses it holds."""
        lan = self.agent("lan")
        try:
            res: dict[str, Any] = lan.get("/v1/router")
            return res
        finally:
            lan.close()

    def set_router(self, name: str) -> dict[str, Any]:
        """Switch the LAN to another router, moving every service address over without a gap."""
        from podmigrate import routing

        if name not in routing.NAMES:
            raise UsageError(f"no router named {name!r}", hint=f"choose one of: {', '.join(routing.NAMES)}")
        lan = self.agent("lan")
        try:
            res: dict[str, Any] = lan.put("/v1/router", {"name": name})
            return res
        finally:
            lan.close()

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        pid = self.holder_pid()
        out: dict[str, Any] = {"name": self.name, "up": pid is not None, "state_dir": str(self.dir)}
        if pid is None:
            return out
        cfg = self.config()
        out.update(
            pid=pid,
            registry=f"http://{layout.REGISTRY}",
            runtime=cfg.get("runtime", "podman"),
            nodes=[],
        )
        lan = self.agent("lan", timeout=5)
        try:
            out["lan"] = {
                "ip": layout.LAN_GATEWAY,
                "agent": "up",
                "router": lan.get("/v1/info").get("router"),
                "routes": lan.get("/v1/routes"),
            }
        except Exception as e:
            out["lan"] = {"ip": layout.LAN_GATEWAY, "agent": f"down: {e}"}
        finally:
            lan.close()
        for n in cfg["nodes"]:
            entry: dict[str, Any] = {"name": n, "ip": layout.node_ip(n), "range": layout.node_range(n)}
            client = self.agent(n, timeout=10)
            try:
                entry["agent"] = client.get("/v1/info")
                entry["containers"] = [
                    {k: c[k] for k in ("name", "state", "ips", "image")} for c in client.get("/v1/containers")
                ]
            except Exception as e:
                entry["agent"] = {"error": str(e)}
            finally:
                client.close()
            out["nodes"].append(entry)
        return out
