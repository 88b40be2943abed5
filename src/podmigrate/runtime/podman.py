"""The Podman + runc + CRIU backend of the node agent (standard library only).

Checkpoints are exported uncompressed (heaps do not compress; see lab notes) with ``--keep`` so that a
failed migration can restore the container in place from podman's own copy. Every CRIU failure is
reported with the tail of CRIU's log, which podman only names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from podmigrate.errors import RuntimeBackendError, UsageError
from podmigrate.runtime import freezer
from podmigrate.runtime.base import ContainerInfo, RunSpec
from podmigrate.runtime.uffd import FaultWaker

_CRIU_LOG = re.compile(r"(/\S+/userdata/(?:dump|restore)\.log)")


def _criu_log_tail(text: str, lines: int = 25) -> list[str]:
    m = _CRIU_LOG.search(text)
    if not m:
        return []
    try:
        with open(m.group(1), errors="replace") as f:
            content = f.read().splitlines()
    except OSError:
        return []
    # CRIU always logs a harmless RLIMIT_NOFILE error here; the real cause is among the last lines
    errs = [x for x in content if "Error" in x and "RLIMIT_NOFILE" not in x]
    return ([*errs[-8:], "...", *content[-lines:]]) if errs else content[-lines:]


CRIU_CONF = Path("/etc/criu/runc.conf")


class Podman:
    # runc hands /etc/criu/runc.conf (node-private in the lab) to CRIU after its own options, which is
    # how podman's ordinary checkpoint/restore become page-server or lazy-pages ones; one at a time
    _criu_lock = threading.Lock()

    def __init__(self, node: str):
        self.node = node

    @contextmanager
    def criu_options(self, *lines: str) -> Iterator[None]:
        if not lines:
            yield
            return
        with self._criu_lock:
            default = CRIU_CONF.with_name("runc.conf.default").read_text()
            CRIU_CONF.write_text(default + "".join(f"{line}\n" for line in lines))
            try:
                yield
            finally:
                CRIU_CONF.write_text(default)

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
                hint="the CRIU log lines are in details.criu_log" if _CRIU_LOG.search(err) else None,
                details={
                    "command": ["podman", *args],
                    "returncode": p.returncode,
                    "stderr": err[-4000:],
                    "criu_log": _criu_log_tail(err),
                    "node": self.node,
                },
            )
        return p

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

    def list_containers(self) -> list[ContainerInfo]:
        ids = self._run("ps", "-a", "-q", "--no-trunc").stdout.split()
        if not ids:
            return []
        # Containers may vanish between the two calls; inspect them one by one in that case.
        p = subprocess.run(["podman", "container", "inspect", *ids], capture_output=True, text=True)
        data = json.loads(p.stdout or "[]")
        return [self._info(d) for d in data]

    @staticmethod
    def _info(d: dict[str, Any]) -> ContainerInfo:
        nets = (d.get("NetworkSettings") or {}).get("Networks") or {}
        ips = [n["IPAddress"] for n in nets.values() if n.get("IPAddress")]
        cfg = d.get("Config") or {}
        return ContainerInfo(
            name=d["Name"],
            id=d["Id"],
            state=d["State"]["Status"],
            image=d.get("ImageName") or cfg.get("Image", ""),
            ips=ips,
            pod=d.get("Pod") or None,
            labels=cfg.get("Labels") or {},
        )

    def inspect(self, name: str) -> ContainerInfo:
        data = json.loads(self._run("container", "inspect", name).stdout)
        return self._info(data[0])

    def run(self, spec: RunSpec) -> ContainerInfo:
        args = ["run", "-d", "--name", spec["name"]]
        if spec.get("pod"):
            args += ["--pod", spec["pod"]]
        else:
            args += ["--network", spec.get("network", "mig")]
            if spec.get("ip"):
                args += ["--ip", spec["ip"]]
        if spec.get("entrypoint"):
            args += ["--entrypoint", json.dumps(spec["entrypoint"])]
        for k, v in (spec.get("env") or {}).items():
            args += ["-e", f"{k}={v}"]
        for k, v in (spec.get("labels") or {}).items():
            args += ["--label", f"{k}={v}"]
        args += [spec["image"], *(spec.get("command") or [])]
        self._run(*args, what=f"starting container {spec['name']}")
        return self.inspect(spec["name"])

    def spec(self, name: str) -> dict[str, Any]:
        """What it takes to start this container afresh elsewhere (the cold-restart baseline)."""
        d = json.loads(self._run("container", "inspect", name).stdout)[0]
        cfg = d.get("Config") or {}
        info = self._info(d)
        nets = list(((d.get("NetworkSettings") or {}).get("Networks") or {}).keys())
        ep = cfg.get("Entrypoint")
        return {
            "name": info["name"],
            "image": info["image"],
            "command": cfg.get("Cmd") or [],
            "entrypoint": ([ep] if isinstance(ep, str) else ep) or [],
            "env": dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e),
            "labels": info["labels"],
            "network": nets[0] if nets else "mig",
            "ip": info["ips"][0] if info["ips"] else "",
        }

    def _tasks(self, name: str) -> list[int]:
        """Every process in the container's PID namespace (empty when it has none)."""
        pid = int(self._run("inspect", "-f", "{{.State.Pid}}", name).stdout.strip() or 0)
        if pid <= 0:
            return []
        ns, tasks = os.readlink(f"/proc/{pid}/ns/pid"), []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        tasks.append(int(entry))
        return tasks

    def rss(self, name: str) -> int:
        """Resident memory of every process of the container (what a restore will have to write)."""
        total = 0
        for task in self._tasks(name):
            with contextlib.suppress(OSError, ValueError, StopIteration):
                status = Path(f"/proc/{task}/status").read_text().splitlines()
                total += int(next(x for x in status if x.startswith("VmRSS:")).split()[1]) * 1024
        return total

    def stop(self, name: str, timeout: float = 2) -> None:
        self._run("stop", "-t", str(int(timeout)), name, what=f"stopping {name}")

    def start(self, name: str) -> None:
        self._run("start", name, what=f"starting {name}")

    def retire(self, name: str, ips: list[str]) -> dict[str, Any]:
        """Cut ``name`` off the network (an nft drop in this node's forward path), then remove it.

        Removing a container closes its sockets, which sends FIN/RST to clients whose connections
        now live on the new copy; the drop rule swallows those. If the rule cannot be set the
        container is removed all the same: two serving copies would be worse than a reset.
        """
        table = "podmigrate_retire_" + re.sub(r"[^A-Za-z0-9_]", "_", name)
        rules = "".join(f"    ip saddr {ip} drop\n    ip daddr {ip} drop\n" for ip in ips)
        nft = (
            f"table inet {table} {{\n  chain block {{\n"
            f"    type filter hook forward priority -300; policy accept;\n{rules}  }}\n}}\n"
        )
        t0 = time.time()
        isolated, error = False, None
        if ips:
            p = subprocess.run(["nft", "-f", "-"], input=nft, capture_output=True, text=True)
            isolated, error = p.returncode == 0, p.stderr.strip()[-500:] or None
        try:
            self.remove(name)  # a container or a whole pod
        finally:
            if isolated:
                subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
        return {"removed": name, "isolated": isolated, "isolation_error": error, "started": t0, "ended": time.time()}

    def create_pod(self, name: str, network: str, ip: str | None = None, mac: str | None = None) -> None:
        args = ["pod", "create", "--name", name, "--network", network]
        if ip:
            args += ["--ip", ip]
        if mac:  # the same MAC too: the node's bridge may still hold the old one in its neighbour cache
            args += ["--mac-address", mac]
        self._run(*args, what=f"creating pod {name}")

    # ------------------------------------------------------------------ whole pods
    def pod_info(self, pod: str) -> dict[str, Any]:
        data = json.loads(self._run("pod", "inspect", pod).stdout)
        data = data[0] if isinstance(data, list) else data
        infra = data.get("InfraContainerID", "")
        members = [c["Name"] for c in data.get("Containers", []) if c["Id"] != infra]
        nets = json.loads(self._run("inspect", "-f", "{{json .NetworkSettings.Networks}}", infra).stdout or "{}")
        macs = [n["MacAddress"] for n in nets.values() if n.get("MacAddress")]
        return {"name": data["Name"], "infra": infra, "members": sorted(members), "mac": macs[0] if macs else None}

    def pod_lock(self, pod: str, on: bool) -> None:
        """Drop (or stop dropping) every packet in the pod's network namespace, loopback included.

        Containers of a pod are dumped and restored one after the other; a packet reaching one
        already dumped, or not yet restored, would be answered with a RST and break the loopback
        connections between them (the study's sidecar finding). The lock closes that window."""
        pid = self._run("inspect", "-f", "{{.State.Pid}}", self.pod_info(pod)["infra"]).stdout.strip()
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
            state = self._run("inspect", "-f", "{{.State.Status}}", name).stdout.strip()
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
        self._run("pod", "start", pod, what=f"starting pod {pod}")
        stats = {}
        self.pod_lock(pod, True)
        try:
            for name, archive in archives.items():
                args = ["container", "restore", "--import", str(archive), "--pod", pod, "--print-stats"]
                if tcp_established:
                    args.append("--tcp-established")
                stats[name] = _stats(self._run(*args, what=f"restore of {name} into pod {pod}").stdout)
        finally:
            self.pod_lock(pod, False)
        for spec in fresh or []:
            self.run({**spec, "pod": pod})
        return {"started": t0, "ended": time.time(), "members": stats, "fresh": [f["name"] for f in fresh or []]}

    def remove(self, name: str) -> None:
        if subprocess.run(["podman", "pod", "exists", name]).returncode == 0:
            self._run("pod", "rm", "-f", "-t", "0", name, missing_ok=True)
        elif subprocess.run(["podman", "container", "exists", name]).returncode == 0:
            self._run("rm", "-f", "-t", "0", name, missing_ok=True)
        else:  # a restore that failed half-way can leave storage behind under the container's ID
            subprocess.run(["podman", "rm", "--storage", name], capture_output=True)

    def checkpoint(
        self,
        name: str,
        archive: Path,
        *,
        tcp_established: bool = True,
        leave_running: bool = False,
        criu: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        args = ["container", "checkpoint", "--export", str(archive), "--compress", "none", "--keep", "--print-stats"]
        if tcp_established:
            args.append("--tcp-established")
        if leave_running:
            args.append("--leave-running")
        # a source that stops for good (or stays frozen until verify) can be frozen the moment CRIU
        # starts; one left running would stay frozen through podman's export
        pid = 0 if leave_running else int(self._run("inspect", "-f", "{{.State.Pid}}", name).stdout.strip() or 0)
        cgroup = freezer.cgroup_dir(pid) if pid > 0 else None
        t0 = time.time()
        with self.criu_options(*criu), freezer.freeze_when_opened(CRIU_CONF, cgroup) as early:
            p = self._run(*args, name, what=f"checkpoint of {name}")
        os.chmod(archive, 0o600)  # it holds the process's memory (the directory is 0700 too)
        stats = _stats(p.stdout)
        res = {"started": t0, "ended": time.time(), "stats": stats, "archive_bytes": archive.stat().st_size}
        if early and early.times:
            res["frozen_early_at"] = early.times.get("frozen_at")
        return res

    def restore_local(self, name: str, *, tcp_established: bool = True) -> dict[str, Any]:
        args = ["container", "restore", "--print-stats"]
        if tcp_established:
            args.append("--tcp-established")
        t0 = time.time()
        p = self._run(*args, name, what=f"restore of {name} in place")
        return {"started": t0, "ended": time.time(), "stats": _stats(p.stdout)}

    def restore_archive(
        self, archive: Path, *, tcp_established: bool = True, criu: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        args = ["container", "restore", "--import", str(archive), "--print-stats"]
        if tcp_established:
            args.append("--tcp-established")
        t0 = time.time()
        with self.criu_options(*criu):
            p = self._run(*args, what="restore from checkpoint archive")
        return {"started": t0, "ended": time.time(), "stats": _stats(p.stdout)}

    # ------------------------------------------------------------------ post-copy (lazy pages)
    def lazy_checkpoint(
        self, name: str, archive: Path, address: str, port: int, *, tcp_established: bool = True
    ) -> tuple[subprocess.Popen[str], dict[str, float]]:
        """Start a lazy-pages dump: CRIU dumps everything but the memory, then serves the pages from
        ``address:port`` until the target has them all (the returned process ends then).

        Podman only exports its archive at the very end, so the few MB the target needs now
        (config.dump, spec.dump, the CRIU images without pages, the root file system's changes) are
        packed into ``archive`` here from the container's own directory, the way podman would."""
        fields = self._run("inspect", "-f", "{{.StaticDir}}|{{.GraphDriver.Data.UpperDir}}|{{.State.Pid}}", name)
        static_dir, upper_dir, pid = fields.stdout.strip().split("|")
        static, upper = Path(static_dir), Path(upper_dir)
        cgroup = freezer.cgroup_dir(int(pid)) if pid.isdigit() else None
        netstatus = self._network_status(name)  # now: the checkpoint holds the container's lock till the end
        args = [
            "podman",
            "container",
            "checkpoint",
            "--export",
            str(archive) + ".full",
            "--compress",
            "none",
            "--keep",
            name,
        ]
        if tcp_established:
            args.insert(3, "--tcp-established")
        times = {"dump_started": time.time()}
        with (
            self.criu_options("lazy-pages", f"address={address}", f"port={port}"),
            freezer.freeze_when_opened(CRIU_CONF, cgroup) as early,
        ):
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 600
            while not listening(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    out, errs = proc.communicate(timeout=10) if proc.poll() is not None else ("", "timed out")
                    raise RuntimeBackendError(
                        f"lazy checkpoint of {name} on {self.node} did not start serving pages: "
                        f"{(errs or out).strip().splitlines()[-1:] or proc.returncode}",
                        details={"stderr": (errs or "")[-3000:], "criu_log": _criu_log_tail(errs or "")},
                    )
                time.sleep(0.005)
        times["serving_at"] = time.time()
        if early:
            times.update(early.times)
        _rootfs_diff(upper, static)
        # what podman's export adds from its database and tmpfs: the addresses (so the copy keeps
        # them) and the contents of /dev/shm
        (static / "network.status").write_text(json.dumps(netstatus))
        if (static / "shm").is_dir():
            subprocess.run(
                ["tar", "-C", str(static / "shm"), "-cf", str(static / "devshm-checkpoint.tar"), "."],
                capture_output=True,
            )
        members = [
            m
            for m in (
                "config.dump",
                "spec.dump",
                "network.status",
                "checkpoint",
                "rootfs-diff.tar",
                "deleted.files",
                "devshm-checkpoint.tar",
            )
            if (static / m).exists()
        ]
        p = subprocess.run(["tar", "-C", str(static), "-cf", str(archive), *members], capture_output=True, text=True)
        if p.returncode:
            proc.kill()
            raise RuntimeBackendError(f"packing the lazy checkpoint of {name} failed: {p.stderr.strip()}")
        os.chmod(archive, 0o600)
        times["packed_at"] = time.time()
        return proc, times

    def _network_status(self, name: str) -> dict[str, Any]:
        """The network.status podman writes into an export (netavark's status block), from inspect."""
        nets = json.loads(self._run("inspect", "-f", "{{json .NetworkSettings.Networks}}", name).stdout or "{}")
        return {
            net: {
                "interfaces": {
                    "eth0": {
                        "subnets": [{"ipnet": f"{n['IPAddress']}/{n['IPPrefixLen']}", "gateway": n["Gateway"]}],
                        "mac_address": n["MacAddress"],
                    }
                }
            }
            for net, n in nets.items()
            if n.get("IPAddress")
        }

    def page_server(self, images: Path, address: str, port: int) -> subprocess.Popen[bytes]:
        """A CRIU page server writing the pages a dump sends into ``images``; returns once it listens."""
        images.mkdir(mode=0o700, exist_ok=True)
        server = subprocess.Popen(
            [
                "criu",
                "page-server",
                "-D",
                str(images),
                "--address",
                address,
                "--port",
                str(port),
                "-o",
                "page-server.log",
                "-v2",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeBackendError(
                    f"criu page-server did not start on {self.node}",
                    details={"log": file_tail(images / "page-server.log")},
                )
            time.sleep(0.01)
        return server

    def lazy_restore(
        self,
        archive: Path,
        images: Path,
        work: Path,
        address: str,
        port: int,
        *,
        tcp_established: bool = True,
        wake_faults: bool = True,
    ) -> tuple[dict[str, Any], subprocess.Popen[bytes], FaultWaker | None]:
        """Restore with the memory left behind: a ``criu lazy-pages`` daemon fetches pages from the
        source as the process touches them (userfaultfd), and the rest in the background.
        ``wake_faults`` re-raises the faults the daemon drops (see ``runtime.uffd``)."""
        images.mkdir(mode=0o700, exist_ok=True)
        work.mkdir(mode=0o700, exist_ok=True)
        p = subprocess.run(
            ["tar", "-C", str(images), "-xf", str(archive), "--strip-components=1", "checkpoint"],
            capture_output=True,
            text=True,
        )
        if p.returncode:
            raise RuntimeBackendError(f"unpacking the lazy checkpoint failed: {p.stderr.strip()}")
        daemon = subprocess.Popen(
            [
                "criu",
                "lazy-pages",
                "--page-server",
                "--address",
                address,
                "--port",
                str(port),
                "-D",
                str(images),
                "-W",
                str(work),
                "-o",
                "lazy-pages.log",
                "-v2",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not (work / "lazy-pages.socket").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                raise RuntimeBackendError(
                    f"criu lazy-pages did not start on {self.node}",
                    details={"log": file_tail(work / "lazy-pages.log")},
                )
            time.sleep(0.005)
        waker = FaultWaker(daemon).start() if wake_faults else None
        # no --print-stats: with a work-dir override podman fails after CRIU restored the process
        args = ["container", "restore", "--import", str(archive)]
        if tcp_established:
            args.append("--tcp-established")
        t0 = time.time()
        try:
            with self.criu_options("lazy-pages", f"work-dir={work}"):
                self._run(*args, what="lazy restore")
        except Exception:
            daemon.kill()
            if waker:
                waker.stop()
            raise
        return {"started": t0, "ended": time.time(), "stats": {}}, daemon, waker

    def resume(self, name: str) -> dict[str, Any]:
        """Wake a container that a dump left stopped (CRIU ``leave-stopped``): thaw its cgroup (frozen
        early for a dump, see ``runtime.freezer``), SIGCONT every task in its PID namespace and drop
        the network lock CRIU left in its network namespace."""
        tasks = self._tasks(name)
        if not tasks:
            raise RuntimeBackendError(f"{name} on {self.node} has no process to resume")
        pid = tasks[0]  # any of them: they share the container's network namespace and cgroup
        cgroup = freezer.cgroup_dir(pid)
        thawed = bool(cgroup and freezer.thaw(cgroup))
        woken = []
        for task in tasks:
            with contextlib.suppress(OSError):
                os.kill(task, signal.SIGCONT)
                woken.append(task)
        # CRIU locks the network with iptables (a CRIU chain jumped to from INPUT and OUTPUT) or with
        # an nft table named CRIU-*, depending on its build; undo whichever is there
        unlocked = []
        for tool in ("iptables", "ip6tables"):
            netns = ["nsenter", "-t", str(pid), "-n", tool]
            if subprocess.run([*netns, "-L", "CRIU", "-n"], capture_output=True).returncode == 0:
                for chain in ("INPUT", "OUTPUT"):  # one jump per interrupted dump: remove them all
                    for _ in range(16):
                        if subprocess.run([*netns, "-D", chain, "-j", "CRIU"], capture_output=True).returncode:
                            break
                for args in (["-F", "CRIU"], ["-X", "CRIU"]):
                    subprocess.run([*netns, *args], capture_output=True)
                unlocked.append(f"{tool}:CRIU")
        tables = subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "nft", "list", "tables"], capture_output=True, text=True
        ).stdout.split("\n")
        for line in tables:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "table" and parts[2].startswith("CRIU"):
                subprocess.run(
                    ["nsenter", "-t", str(pid), "-n", "nft", "delete", "table", parts[1], parts[2]], capture_output=True
                )
                unlocked.append(parts[2])
        return {"woken": woken, "unlocked": unlocked, "thawed": thawed}

    def ensure_image(self, image: str) -> bool:
        if subprocess.run(["podman", "image", "exists", image]).returncode == 0:
            return False
        self._run("pull", "-q", image, what=f"pulling image {image}")
        return True


_PODMAN_FILES = {"etc/mtab", "run/.containerenv", "etc/hosts", "etc/hostname", "etc/resolv.conf"}


def _rootfs_diff(upper: Path, bundle: Path) -> None:
    """Write rootfs-diff.tar and deleted.files into ``bundle`` from the overlay upper directory, as
    podman's export does: changed files as a tar, whiteouts (0:0 character devices) as a list."""
    import stat as st
    import tarfile

    added, deleted = [], []
    for root, dirs, files in os.walk(upper):
        for f in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, f)
            rel = os.path.relpath(path, upper)
            if rel in _PODMAN_FILES:
                continue
            info = os.lstat(path)
            if st.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                deleted.append("/" + rel)
            else:
                added.append(rel)
    for f in ("rootfs-diff.tar", "deleted.files"):
        (bundle / f).unlink(missing_ok=True)
    if added:
        with tarfile.open(bundle / "rootfs-diff.tar", "w") as t:
            for rel in added:
                t.add(os.path.join(upper, rel), arcname=rel, recursive=False)
    if deleted:
        (bundle / "deleted.files").write_text(json.dumps(deleted))


def listening(port: int) -> bool:
    """Whether something listens on TCP ``port`` in this network namespace."""
    suffix = f":{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(x.split()[1].endswith(suffix) and x.split()[3] == "0A" for x in f.readlines()[1:])


def file_tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _stats(stdout: str) -> dict[str, Any]:
    """The statistics JSON that ``--print-stats`` prints (podman adds nothing else with it)."""
    i = stdout.find("{")
    if i < 0:
        return {}
    try:
        data: dict[str, Any] = json.loads(stdout[i:])
    except json.JSONDecodeError:
        return {}
    ctr = (data.get("container_statistics") or [{}])[0]
    out: dict[str, Any] = dict(ctr.get("criu_statistics") or {})
    for k, v in data.items():
        if k.endswith("_duration"):
            out[k] = v
    for k, v in ctr.items():
        if k.endswith("_duration"):
            out[k] = v
    return out
