"""The container verbs of the Podman backend: run, inspect, list, stop/start/retire, checkpoint and restore, images.

Checkpoints are exported uncompressed (heaps do not compress; see lab notes) with ``--keep`` so that a
failed migration can restore the container in place from podman's own copy. Built on ``podman_cli``;
``podman_pod`` dumps pods with these verbs; ``podman.Podman`` joins them with ``lazy``. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from podmigrate import names
from podmigrate.errors import RuntimeBackendError
from podmigrate.runtime import freezer, hugepages, speculative
from podmigrate.runtime.base import ContainerInfo, RunSpec
from podmigrate.runtime.criu_conf import criu_spans, parse_stats
from podmigrate.runtime.podman_cli import PodmanCLI, container_info, restore_network


class PodmanContainers(PodmanCLI):
    def list_containers(self) -> list[ContainerInfo]:
        """Every container of the node. One in a lazy dump is listed as this agent saw it before the
        dump, state ``checkpointing``: podman would wait for the dump's end (the whole page tail)
        to show it, and with it every other (another migration's validate waited 1.8 s here). The
        IDs come from podman's database, read without its locks (``podman ps`` where it cannot be
        read): one podman command less, and every migration lists both nodes."""
        for cid in [c for c, (proc, _) in list(self.dumping.items()) if proc.poll() is not None]:
            self.dumping.pop(cid, None)
        busy = {cid: info for cid, (_proc, info) in list(self.dumping.items())}
        known = speculative.container_ids()
        if known is not None:
            ids = [i for i in known if i not in busy]
        else:
            ids = self._run("ps", "-a", "-q", "--no-trunc").stdout.split()
        data: list[dict[str, Any]] = []
        if ids:
            # Containers may vanish between the two calls; inspect them one by one in that case.
            p = subprocess.run(["podman", "container", "inspect", *ids], capture_output=True, text=True)
            data = json.loads(p.stdout or "[]")
        listed = [container_info(d) for d in data if d["Id"] not in busy]
        return listed + [info for cid, info in busy.items() if known is None or cid in known]

    def inspect(self, name: str) -> ContainerInfo:
        data = json.loads(self._run("container", "inspect", "--", name).stdout)
        return container_info(data[0])

    def run(self, spec: RunSpec) -> ContainerInfo:
        names.name(spec.get("name"))
        names.image(spec.get("image"))
        for key in ("pod", "network"):
            if spec.get(key):
                names.name(spec.get(key), key)
        if spec.get("ip"):
            names.ipv4(spec.get("ip"))
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
        args += ["--", spec["image"], *(spec.get("command") or [])]
        self._run(*args, what=f"starting container {spec['name']}")
        return self.inspect(spec["name"])

    def spec(self, name: str) -> dict[str, Any]:
        """What it takes to start this container afresh elsewhere (the cold-restart baseline)."""
        d = json.loads(self._run("container", "inspect", "--", name).stdout)[0]
        cfg = d.get("Config") or {}
        info = container_info(d)
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
            # what a restore on another node cannot bring along by itself (engine.phases.fit says why)
            "mounts": [
                {"type": m.get("Type", ""), "source": m.get("Source", ""), "destination": m.get("Destination", "")}
                for m in d.get("Mounts") or []
            ],
            "devices": [x.get("PathOnHost", "") for x in (d.get("HostConfig") or {}).get("Devices") or []],
            "ports": sorted(k for k, v in ((d.get("HostConfig") or {}).get("PortBindings") or {}).items() if v),
            "published": _published((d.get("HostConfig") or {}).get("PortBindings") or {}),
        }

    def huge_pages(self, name: str) -> dict[str, Any]:
        """Collapse the memory a lazy restore filled 4 KB at a time back into huge pages where the
        workload would have them (``runtime.hugepages``)."""
        return hugepages.collapse(self._tasks(name))

    def _tasks(self, name: str) -> list[int]:
        """Every process in the container's PID namespace (empty when it has none)."""
        pid = int(self._run("inspect", "-f", "{{.State.Pid}}", "--", name).stdout.strip() or 0)
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
        self._run("stop", "-t", str(int(timeout)), "--", name, what=f"stopping {name}")

    def start(self, name: str) -> None:
        self._run("start", "--", name, what=f"starting {name}")

    def rename(self, name: str, new: str) -> None:
        self._run("rename", "--", name, names.name(new), what=f"renaming {name} to {new}")

    def retire(self, name: str, ips: list[str]) -> dict[str, Any]:
        """Cut ``name`` off the network (an nft drop in this node's forward path), then remove it.

        Removing a container closes its sockets, which sends FIN/RST to clients whose connections
        now live on the new copy; the drop rule swallows those. If the rule cannot be set the
        container is removed all the same: two serving copies would be worse than a reset.
        """
        table = "podmigrate_retire_" + re.sub(r"[^A-Za-z0-9_]", "_", names.name(name))
        addresses = [names.ipv4(ip) for ip in ips]  # parsed: nothing else may reach the nft script
        rules = "".join(f"    ip saddr {ip} drop\n    ip daddr {ip} drop\n" for ip in addresses)
        nft = (
            f"table inet {table} {{\n  chain block {{\n"
            f"    type filter hook forward priority -300; policy accept;\n{rules}  }}\n}}\n"
        )
        t0 = time.time()
        isolated, error = False, None
        if addresses:
            p = subprocess.run(["nft", "-f", "-"], input=nft, capture_output=True, text=True)
            isolated, error = p.returncode == 0, p.stderr.strip()[-500:] or None
        try:
            self.remove(name)  # a container or a whole pod
        finally:
            if isolated:
                subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
        return {"removed": name, "isolated": isolated, "isolation_error": error, "started": t0, "ended": time.time()}

    def remove(self, name: str) -> None:
        if subprocess.run(["podman", "pod", "exists", "--", name]).returncode == 0:
            self._run("pod", "rm", "-f", "-t", "0", "--", name, missing_ok=True)
        elif subprocess.run(["podman", "container", "exists", "--", name]).returncode == 0:
            self._run("rm", "-f", "-t", "0", "--", name, missing_ok=True)
        else:  # a restore that failed half-way can leave storage behind under the container's ID
            subprocess.run(["podman", "rm", "--storage", "--", name], capture_output=True)

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
        else:  # connections that cannot follow (their address changes) are closed, not a failed dump
            criu += ("tcp-close",)
        if leave_running:
            args.append("--leave-running")
        fmt = "{{.State.Pid}}|{{.StaticDir}}|{{.ID}}"
        pid, static, cid = self._run("inspect", "-f", fmt, "--", name).stdout.strip().split("|")
        # a source that stops for good (or stays frozen until verify) can be frozen the moment CRIU
        # starts; one left running would stay frozen through podman's export
        cgroup = freezer.cgroup_dir(int(pid)) if pid.isdigit() and int(pid) > 0 and not leave_running else None
        t0 = time.time()
        with (
            self.criu_options(*criu, container_id=cid) as conf,
            freezer.freeze_when_opened(conf, cgroup) as early,
        ):
            p = self._run(*args, "--", name, what=f"checkpoint of {name}")
        ended = time.time()
        os.chmod(archive, 0o600)  # it holds the process's memory (the directory is 0700 too)
        stats = parse_stats(p.stdout)
        times = early.times if early else {}
        res = {"started": t0, "ended": ended, "stats": stats, "archive_bytes": archive.stat().st_size}
        res["timeline"] = criu_spans("dump", t0, times.get("opened_at"), Path(static) / "dump.log", ended)
        if times.get("frozen_at"):
            res["frozen_early_at"] = times["frozen_at"]
        return res

    def restore_local(self, name: str, *, tcp_established: bool = True) -> dict[str, Any]:
        args = ["container", "restore", "--print-stats"]
        if tcp_established:
            args.append("--tcp-established")
        t0 = time.time()
        with self.criu_options():
            p = self._run(*args, "--", name, what=f"restore of {name} in place")
        return {"started": t0, "ended": time.time(), "stats": parse_stats(p.stdout)}

    def restore_archive(
        self, archive: Path, *, tcp_established: bool = True, criu: tuple[str, ...] = (), network: str = "keep"
    ) -> dict[str, Any]:
        args = ["container", "restore", "--import", str(archive), "--print-stats", *restore_network(network)]
        if tcp_established:
            args.append("--tcp-established")
        else:
            criu += ("tcp-close",)
        t0 = time.time()
        with self.criu_options(*criu) as conf, freezer.freeze_when_opened(conf, None) as noted:
            p = self._run(*args, what="restore from checkpoint archive")
        ended = time.time()
        stats = parse_stats(p.stdout)
        opened = noted.times.get("opened_at") if noted else None
        # podman deletes restore.log with the imported checkpoint; CRIU's own statistics (forking
        # and restoring the tasks) are what is known of its run
        criu_s = (stats.get("forking_time", 0) + stats["restore_time"]) / 1e6 if "restore_time" in stats else None
        return {
            "started": t0,
            "ended": ended,
            "stats": stats,
            "timeline": criu_spans("restore", t0, opened, None, ended, criu_s),
        }

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

    def ensure_image(self, image: str, image_id: str = "") -> dict[str, Any]:
        """The image here, by ``image_id`` when given (a same-named image built or imported on this node
        alone is another image: a restore of the source's container would fail on it). Pulls ``image``
        if need be; ``present`` False (with ``why``) when this node cannot get that image by itself."""
        if image_id and self.has_image(image_id):
            return {"present": True, "pulled": False}
        if not image_id and subprocess.run(["podman", "image", "exists", "--", image]).returncode == 0:
            return {"present": True, "pulled": False}
        p = subprocess.run(["podman", "pull", "-q", "--", image], capture_output=True, text=True)
        if p.returncode == 0 and (not image_id or self.has_image(image_id)):
            return {"present": True, "pulled": True}
        if not image_id:
            self._run("pull", "-q", "--", image, what=f"pulling image {image}")  # raises with podman's reason
        why = (p.stderr.strip().splitlines() or ["?"])[-1] if p.returncode else f"{image} here is another image"
        return {"present": False, "pulled": False, "why": why}

    def has_image(self, image_id: str) -> bool:
        p = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Id}}", "--", image_id], capture_output=True, text=True
        )
        return p.returncode == 0 and p.stdout.strip() == image_id

    def save_image(self, image_id: str, archive: Path) -> None:
        self._run(
            "save",
            "-q",
            "--format",
            "oci-archive",
            "-o",
            str(archive),
            "--",
            image_id,
            what=f"saving image {image_id[:12]}",
        )

    def load_image(self, archive: Path, image_id: str, name: str) -> None:
        """Load the source's image; refused unless it is the same image (its ID) after the load."""
        self._run("load", "-q", "-i", str(archive), what="loading the source's image")
        if not self.has_image(image_id):
            raise RuntimeBackendError(
                f"the image loaded from the source is not {image_id[:12]}", hint="the source's image changed meanwhile?"
            )
        if name and not name.startswith("sha256:") and name != image_id:
            self._run("tag", "--", image_id, name, what=f"tagging {image_id[:12]} as {name}")


def _published(bindings: dict[str, Any]) -> list[dict[str, Any]]:
    """Podman's ``PortBindings`` (``{"8000/tcp": [{"HostIp": "", "HostPort": "8080"}]}``), one entry
    per host port."""
    out = []
    for key, binds in sorted(bindings.items()):
        port, _, proto = key.partition("/")
        for b in binds or []:
            out.append({"container_port": int(port), "protocol": proto or "tcp", "host_ip": b.get("HostIp") or "",
                        "host_port": int(b.get("HostPort") or 0)})  # fmt: skip
    return out
