"""Inside the lab: the lab holder and the node holders (runs on the node image's python3, stdlib only).

The host starts ``python3 -m podmigrate.lab.init lab`` right after pivot_root into the node image, in
a private mount namespace and in the cgroup ``<cg2>/podmigrate-<lab>/lab``. That process (the lab
holder) mounts its own /run, /tmp and cgroup2, builds the LAN (bridge + one veth per node), then starts
and supervises the registry, one node holder per node, one agent per node and the LAN agent. A node
holder (``... init node NAME``) owns the node's mount and cgroup namespaces; it mounts the node's own
container storage and ends as ``sleep``. The host reads everything it needs from files in the lab's
state directory (``pids/``, ``agents/``, ``ready``): no other channel is needed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from podmigrate import layout, procs
from podmigrate.lab import containerd, guard

STATE = Path(layout.IN_LAB_STATE)
ENV = {
    "PATH": layout.LAB_PATH,
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "PYTHONPATH": layout.IN_LAB_SRC,
    "PYTHONDONTWRITEBYTECODE": "1",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def join_cgroup(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def service_pid(name: str) -> str:
    """The running process of supervised service ``name`` (its pid file), for nsenter -t."""
    p = procs.read_pidfile(STATE / "pids" / f"{name}.pid")
    if p is None:
        raise RuntimeError(f"{name} is not running")
    return str(p.pid)


def config() -> dict[str, Any]:
    with open(STATE / "lab.json") as f:
        data: dict[str, Any] = json.load(f)
    return data


# ---------------------------------------------------------------- lab holder


def setup_mounts(cg: str, nodes: list[str]) -> None:
    sh("umount", "-l", "/oldroot")
    sh("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run")
    sh("mount", "-t", "tmpfs", "tmpfs", "/tmp")
    # The host's /sys/fs/cgroup is a tmpfs of v1 hierarchies; replace it, in this namespace only, by
    # the cgroup2 hierarchy that podman (cgroupfs manager) and CRIU can use.
    sh("umount", "-l", "/sys/fs/cgroup")
    sh("mount", "-t", "cgroup2", "none", "/sys/fs/cgroup")
    for n in nodes:
        os.makedirs(f"/sys/fs/cgroup/{cg}/{n}", exist_ok=True)
    os.makedirs("/run/netns", exist_ok=True)


def setup_network(nodes: list[str]) -> None:
    sh("ip", "netns", "add", "lan")
    sh("ip", "-n", "lan", "link", "set", "lo", "up")
    sh("ip", "-n", "lan", "link", "add", layout.LAN_BRIDGE, "type", "bridge")
    sh("ip", "-n", "lan", "addr", "add", f"{layout.LAN_GATEWAY}/{layout.LAN_PREFIX}", "dev", layout.LAN_BRIDGE)
    sh("ip", "-n", "lan", "link", "set", layout.LAN_BRIDGE, "up")
    for n in nodes:
        ip = layout.node_ip(n)
        sh("ip", "netns", "add", n)
        sh("ip", "link", "add", "name", f"v{n}", "netns", "lan", "type", "veth", "peer", "name", "eth0", "netns", n)
        sh("ip", "-n", "lan", "link", "set", f"v{n}", "master", layout.LAN_BRIDGE, "up")
        sh("ip", "-n", n, "link", "set", "lo", "up")
        sh("ip", "-n", n, "addr", "add", f"{ip}/{layout.LAN_PREFIX}", "dev", "eth0")
        sh("ip", "-n", n, "link", "set", "eth0", "up")
        sh("ip", "-n", n, "route", "add", "default", "via", layout.LAN_GATEWAY)
        # nsenter, not `ip netns exec`: the latter remounts /sys and would hide our cgroup2 mount
        sh("nsenter", f"--net=/run/netns/{n}", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        # the node's container subnet is routed to it; a migrated container gets a /32 of its own
        sh("ip", "-n", "lan", "route", "add", layout.node_range(n), "via", ip)
        guard.apply(n, ENV)


class Service:
    """A supervised child process; restarted when it dies unless ``hold/<name>`` exists."""

    def __init__(self, name: str, argv: list[str], cgroup: str | None = None):
        self.name, self.argv, self.cgroup = name, argv, cgroup
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.next_start = 0.0

    def start(self) -> None:
        out = open(STATE / "logs" / f"{self.name}.log", "ab")
        cg = self.cgroup
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
            start_new_session=True,
            preexec_fn=(lambda: join_cgroup(cg)) if cg else None,
        )
        out.close()
        procs.write_pidfile(STATE / "pids" / f"{self.name}.pid", self.proc.pid)

    def check(self) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        if (STATE / "hold" / self.name).exists() or time.monotonic() < self.next_start:
            return
        log(f"{self.name} exited with {self.proc.returncode}; restarting")
        self.restarts += 1
        self.next_start = time.monotonic() + min(5.0, 0.2 * self.restarts)
        self.start()


def agent_argv(role: str, name: str, listen_ip: str, peers: list[str]) -> list[str]:
    """An agent: its Unix socket for the controller (token), its TCP port for the other nodes
    (mutual TLS with the lab's certificates, ``peers`` the names let in)."""
    pki = STATE / "pki"
    return [
        "python3",
        "-m",
        "podmigrate.agent.server",
        "--role",
        role,
        "--name",
        name,
        "--uds",
        f"{STATE}/agents/{name}.sock",
        "--tcp",
        f"{listen_ip}:{layout.AGENT_PORT}",
        "--token-file",
        f"{STATE}/token",
        "--tls-cert",
        f"{pki}/{name}.crt",
        "--tls-key",
        f"{pki}/{name}.key",
        "--tls-ca",
        f"{pki}/ca.crt",
        *(arg for p in peers for arg in ("--peer", p)),
    ]


def containerd_services(cg: str, nodes: list[str]) -> list[Service]:
    """Per node: containerd in the node's namespaces, and the registry at localhost:5000."""
    out = []
    for n in nodes:
        holder = service_pid(f"holder-{n}")
        os.makedirs(f"/sys/fs/cgroup/{cg}/{n}/containerd", exist_ok=True)
        relay = ["python3", "-m", "podmigrate.lab.containerd", "relay", "5000", layout.REGISTRY]
        out.append(Service(f"relay-{n}", ["nsenter", f"--net=/run/netns/{n}", *relay]))
        out.append(
            Service(
                f"containerd-{n}",
                [
                    "nsenter",
                    "-t",
                    holder,
                    "-m",
                    "-n",
                    "-C",
                    "-r",
                    "-w",
                    "--",
                    "containerd",
                    "--config",
                    "/etc/containerd/config.toml",
                ],
                cgroup=f"/sys/fs/cgroup/{cg}/{n}/containerd",
            )
        )
    return out


def push_pause_image() -> None:
    """containerd's sandbox image, made here and pushed once into the lab's registry."""
    layout_dir = STATE / "pause-oci"
    containerd.pause_layout(layout_dir)
    tag = containerd.PAUSE_IMAGE.rsplit(":", 1)[1]
    skopeo = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    argv = [
        "nsenter",
        "--net=/run/netns/lan",
        *skopeo,
        f"oci:{layout_dir}:{tag}",
        f"docker://{layout.REGISTRY}/pause:{tag}",
    ]
    deadline = time.monotonic() + 30
    while sh(*argv, check=False).returncode:  # the registry may still be starting
        if time.monotonic() > deadline:
            sh(*argv)
        time.sleep(0.2)


def wait_files(paths: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return
        time.sleep(0.05)
    missing = [str(p) for p in paths if not p.exists()]
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}: {missing}")


def lab_main() -> None:
    cfg = config()
    cg, nodes = cfg["cgroup"], cfg["nodes"]
    for d in ("pids", "agents", "logs", "hold"):
        (STATE / d).mkdir(exist_ok=True)
    setup_mounts(cg, nodes)
    setup_network(nodes)
    services = [
        Service("registry", ["nsenter", "--net=/run/netns/lan", "docker-registry", "serve", f"{STATE}/registry.yml"])
    ]
    for n in nodes:
        services.append(
            Service(
                f"holder-{n}",
                [
                    "nsenter",
                    f"--net=/run/netns/{n}",
                    "unshare",
                    "-m",
                    "-C",
                    "--propagation",
                    "private",
                    "python3",
                    "-m",
                    "podmigrate.lab.init",
                    "node",
                    n,
                ],
                cgroup=f"/sys/fs/cgroup/{cg}/{n}",
            )
        )
    for s in services:
        s.start()
    wait_files([STATE / "pids" / f"{n}.ready" for n in nodes], 120, "node holders")
    lan_argv = [*agent_argv("lan", "lan", layout.LAN_GATEWAY, nodes), "--router-file", f"{STATE}/router"]
    lan_argv += ["--controller", layout.CONTROLLER]  # the LAN as the static router of the lab driven as hosts
    services.append(Service("lan", ["nsenter", "--net=/run/netns/lan", *lan_argv]))
    for n in nodes:
        holder = service_pid(f"holder-{n}")
        services.append(
            Service(
                n,
                [
                    "nsenter",
                    "-t",
                    holder,
                    "-m",
                    "-n",
                    "-C",
                    "-r",
                    "-w",
                    "--",
                    *agent_argv("node", n, layout.node_ip(n), [x for x in nodes if x != n]),
                    # the lab's nodes as hosts (``lab.hosts_view``): the lab CA's controller certificate
                    "--controller",
                    layout.CONTROLLER,
                ],
                cgroup=f"/sys/fs/cgroup/{cg}/{n}/init",
            )
        )
    if cfg.get("runtime") == "containerd":
        services += containerd_services(cg, nodes)
    for s in services[len(nodes) + 1 :]:
        s.start()
    wait_files([STATE / "agents" / f"{n}.sock" for n in ["lan", *nodes]], 60, "agents")
    if cfg.get("runtime") == "containerd":
        push_pause_image()
        wait_files([Path(containerd.socket_path(n)) for n in nodes], 60, "containerd's CRI sockets")
    (STATE / "ready").write_text(str(os.getpid()))
    log("lab ready")
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop:
        for s in services:
            if not s.name.startswith("holder-"):
                s.check()
        time.sleep(0.2)


# ---------------------------------------------------------------- node holder


def node_main(name: str) -> None:
    """Runs in the node's fresh mount + cgroup namespaces (and its network namespace)."""
    base = STATE / "nodes" / name
    sh("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run")
    # /run/netns a shared mount of itself before containerd puts pod namespaces in it: Podman and
    # `ip netns` make it one on first use when it is not, and that bind would cover the namespaces
    # mounted there before it, which containerd then cannot remove (its pods hang in Terminating)
    os.makedirs("/run/netns", exist_ok=True)
    sh("mount", "--bind", "/run/netns", "/run/netns")
    sh("mount", "--make-shared", "/run/netns")
    sh("mount", "-t", "tmpfs", "tmpfs", "/tmp")
    sh("umount", "-l", "/sys/fs/cgroup")
    sh("mount", "-t", "cgroup2", "none", "/sys/fs/cgroup")  # shows only this node's subtree
    os.makedirs("/sys/fs/cgroup/init", exist_ok=True)
    join_cgroup("/sys/fs/cgroup/init")  # keeps the node's root cgroup free of processes
    # CRIU's options for runc live in /etc/criu/runc.conf; each node gets its own copy so that its
    # agent can add page-server or lazy-pages options for one migration without touching other nodes
    criu_etc = base / "criu-etc"
    criu_etc.mkdir(parents=True, exist_ok=True)
    (criu_etc / "runc.conf").write_text(open("/etc/criu/runc.conf").read())
    (criu_etc / "runc.conf.default").write_text(open("/etc/criu/runc.conf").read())
    (criu_etc / Path(containerd.CRIU_CONF).name).write_text(
        open("/etc/criu/runc.conf").read() + containerd.CRIU_CONF_EXTRA
    )
    for sub, target in (
        ("criu-etc", "/etc/criu"),
        ("containers", "/var/lib/containers"),
        ("networks", "/etc/containers/networks"),
        ("checkpoints", layout.NODE_CHECKPOINTS),
        ("vartmp", "/var/tmp"),
    ):
        (base / sub).mkdir(parents=True, exist_ok=True)
        os.makedirs(target, exist_ok=True)
        sh("mount", "--bind", str(base / sub), target)
    os.chmod(layout.NODE_CHECKPOINTS, 0o700)  # checkpoints hold process memory: secrets
    if config().get("runtime") == "containerd":
        containerd.prepare_node(base, name, lambda src, dst: sh("mount", "--bind", src, dst))
    if sh("podman", "network", "exists", layout.WORKLOAD_NETWORK, check=False).returncode:
        sh(
            "podman",
            "network",
            "create",
            "--disable-dns",
            "--subnet",
            layout.WORKLOAD_SUBNET,
            "--gateway",
            layout.WORKLOAD_GATEWAY,
            "--ip-range",
            layout.node_range(name),
            layout.WORKLOAD_NETWORK,
        )
    (STATE / "pids" / f"{name}.ready").write_text(str(os.getpid()))
    os.execvp("sleep", ["sleep", "infinity"])


def main(argv: list[str]) -> None:
    # the lab's services (containerd, the kubelets, the agents) get the usual umask, not their
    # starter's: under 077, containerd's snapshots (every container's /) were 0700 and a container
    # running as a non-root user could not run anything
    os.umask(0o022)
    if argv[:1] == ["lab"]:
        lab_main()
    elif argv[:1] == ["node"] and len(argv) == 2:
        node_main(argv[1])
    else:
        sys.exit("usage: python3 -m podmigrate.lab.init lab | node NAME")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception as e:  # the host shows this log when start-up fails
        log(f"FATAL: {e}")
        raise
