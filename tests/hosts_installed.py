"""A lab's nodes made into hosts the way docs/hosts.md sets up two machines, for the hosts test.

Each node gets a second LAN address (``SECOND``) and the LAN one for a router (``ROUTER_ADDRESS``); an
inventory of its own names those, with a state directory and a CA of its own. ``podmigrate hosts
init`` makes the bundles; on each node ``hosts install-agent --root`` (the library call the command
makes, on the node's own Python) writes ``etc/podmigrate`` and the systemd unit; the node's
``/etc/podmigrate`` is then that directory, and the agent is started as systemd would start the unit:
its ``ExecStart`` with the words of its ``EnvironmentFile`` (the nodes have no systemd). The static
router's bundle runs the same way in the LAN's namespace. The lab's own agents, on the nodes' first
addresses, take no part: the controller reaches only the inventory's.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from podmigrate import layout
from podmigrate.hosts.agent_unit import UNIT_NAME
from podmigrate.lab.cluster import Lab
from podmigrate.lab.host import join

SECOND = {"node-a": "10.77.0.21", "node-b": "10.77.0.22"}
ROUTER_ADDRESS = "10.77.0.2"
# what `pip install podmigrate` gives a real host: the package importable by the unit's Python
PACKAGE_ENV = [f"PYTHONPATH={layout.IN_LAB_SRC}", "PYTHONDONTWRITEBYTECODE=1"]
INSTALL = "import sys; from pathlib import Path; from podmigrate.hosts.agent_unit import install; " \
          "print(install(Path(sys.argv[1]), Path(sys.argv[2])))"  # fmt: skip


def systemd_argv(unit: str, env_file: str) -> list[str]:
    """The argv systemd runs for ``unit``'s ExecStart: a ``$VAR`` word replaced by the variable of the
    EnvironmentFile (its quotes removed) split at whitespace, as systemd.exec documents."""
    env: dict[str, str] = {}
    for line in env_file.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            (env[key.strip()],) = shlex.split(value)
    (start,) = (line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart="))
    argv: list[str] = []
    for word in start.split():
        argv += env[word[1:]].split() if word.startswith("$") else [word]
    return argv


@dataclass
class Installed:
    lab: Lab
    dir: Path  # in the lab's directory: the inventories, the controller's state, each machine's root
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    undo: list[Callable[[], object]] = field(default_factory=list)

    def inventory(self, router: str = "none", network: str = "podman") -> Path:
        hosts = "".join(f'\n[hosts.{n}]\naddress = "{ip}"\n' for n, ip in SECOND.items())
        routing = f'[router]\naddress = "{ROUTER_ADDRESS}"\n' if router == "static" else f'router = "{router}"\n'
        path = self.dir / f"hosts-{router}.toml"
        path.write_text(f'state = "state"\nnetwork = "{network}"\n{routing}{hosts}')
        return path

    def in_lab(self, path: Path) -> str:
        return f"{layout.IN_LAB_STATE}/{path.relative_to(self.lab.dir)}"

    def start(self, machine: str, bundle: Path) -> None:
        """Install ``bundle`` on ``machine`` (a node, or ``lan`` for the router) and start its unit."""
        lab, root = self.lab, self.dir / "roots" / machine
        lab.run(machine, ["env", *PACKAGE_ENV, "python3", "-c", INSTALL, self.in_lab(bundle), self.in_lab(root)])
        etc = self.in_lab(root / "etc" / "podmigrate")
        unit = (root / "etc" / "systemd" / "system" / UNIT_NAME).read_text()
        assert "EnvironmentFile=/etc/podmigrate/agent.env" in unit, unit
        argv = systemd_argv(unit, (root / "etc" / "podmigrate" / "agent.env").read_text())
        if machine == "lan":  # the LAN's mount namespace is the lab holder's: a private one for the router
            argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                    f'mount --bind {etc} /etc/podmigrate && exec "$@"', "sh", *argv]  # fmt: skip
        else:  # the node's own /etc/podmigrate is the installed one (the lab's file in it kept)
            lab.run(machine, ["sh", "-c", f"cp -p /etc/podmigrate/runc-restore.json {etc}/ && "
                                          f"mount --bind {etc} /etc/podmigrate"])  # fmt: skip
            self.undo.append(lambda: lab.run(machine, ["umount", "/etc/podmigrate"], check=False))
        cmd, cgroup = lab.command(machine, ["env", *PACKAGE_ENV, *argv])
        log = open(lab.dir / "logs" / f"installed-agent-{machine}.log", "ab")
        self.agents.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=join(cgroup)))  # fmt: skip
        log.close()

    def stop(self) -> None:
        for proc in self.agents:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.agents:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for undo in reversed(self.undo):
            undo()


@contextlib.contextmanager
def install(lab: Lab, init: Callable[[Path], subprocess.CompletedProcess[str]]) -> Iterator[Installed]:
    """The nodes as hosts with installed agents, for the block's length. ``init`` runs
    ``podmigrate hosts init INVENTORY`` as the controller does."""
    inst = Installed(lab, lab.dir / "installed")
    try:
        addresses = [*((n, ip, "eth0") for n, ip in SECOND.items()), ("lan", ROUTER_ADDRESS, layout.LAN_BRIDGE)]
        for machine, ip, dev in addresses:
            address = ["addr", f"{ip}/{layout.LAN_PREFIX}", "dev", dev]
            lab.run(machine, ["ip", address[0], "replace", *address[1:]])
            inst.undo.append(functools.partial(lab.run, machine, ["ip", address[0], "del", *address[1:]], check=False))
        inst.dir.mkdir(exist_ok=True)
        made = init(inst.inventory("static"))  # the static router's bundle beside the hosts'
        assert made.returncode == 0, made.stderr + made.stdout
        bundles = inst.dir / "state" / "bundles"
        for node in SECOND:
            inst.start(node, bundles / node)
        inst.start("lan", bundles / "router")
        yield inst
    finally:
        inst.stop()
