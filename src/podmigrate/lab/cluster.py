"""Start, inspect, enter and stop a lab from the host.

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
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import podmigrate
from podmigrate import layout
from podmigrate.client import AgentClient
from podmigrate.errors import LabError, PreflightError, UsageError
from podmigrate.lab import preflight
from podmigrate.lab.image import NodeImage

Report = Callable[[str], None]
LAZY_PIPE_MAX = 4194304
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,19}$")

# Stage 1 runs on the host's tools inside a fresh private mount namespace: bind the node image and
# the lab's directories into place, pivot into the image, and hand over to the lab holder.
STAGE1 = """\
set -e
R=$1 L=$2 C=$3 P=$4
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount --rbind /dev "$R/dev"
mount --rbind /sys "$R/sys"
mount --bind "$L" "$R/var/lib/podmigrate-lab"
mount --bind "$C" "$R/var/lib/podmigrate-cache"
mount --bind "$P" "$R/opt/podmigrate/podmigrate"
mount -o remount,bind,ro "$R/opt/podmigrate/podmigrate"
cd "$R"
pivot_root . oldroot
cd /
exec env -i PATH={path} HOME=/root LC_ALL=C.UTF-8 PYTHONPATH=/opt/podmigrate PYTHONDONTWRITEBYTECODE=1 \
    python3 -m podmigrate.lab.init lab
""".replace("{path}", layout.LAB_PATH)

REGISTRY_YML = f"""\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {layout.IN_LAB_STATE}/registry
  delete:
    enabled: true
http:
  addr: {layout.REGISTRY}
"""


def home() -> Path:
    return Path(os.environ.get("PODMIGRATE_HOME", "/var/lib/podmigrate"))


def cgroup2_root() -> Path:
    """Where the host mounts the unified hierarchy (/sys/fs/cgroup/unified on hybrid hosts)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return Path(left.split()[4])
    raise LabError(
        "no cgroup2 hierarchy is mounted on the host",
        hint="mount -t cgroup2 none /sys/fs/cgroup/unified (hybrid) or boot with cgroup v2",
    )


def _join(cgroup: Path) -> Callable[[], None]:
    def join() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    return join


class Lab:
    def __init__(self, name: str = "default"):
        if not _NAME.match(name):
            raise UsageError(f"not a valid lab name: {name!r}", hint="use 1-20 of a-z, 0-9 and '-'")
        self.name = name
        self.base = home()
        self.dir = self.base / "labs" / name
        self.image = NodeImage(self.base / "node-image" / "rootfs")
        self.cache = self.base / "cache"

    # ------------------------------------------------------------------ state
    @property
    def cgroup(self) -> Path:
        return cgroup2_root() / layout.cgroup_name(self.name)

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
        try:
            pid = int((self.dir / "lab.pid").read_text())
            ready = int((self.dir / "ready").read_text())
        except (OSError, ValueError):
            return None
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
                return None
        except OSError:
            return None
        return pid if ready == pid else None

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
        return int((self.dir / "pids" / f"holder-{node}.pid").read_text())

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
        p = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, input=input, preexec_fn=_join(cg))
        if check and p.returncode:
            raise LabError(
                f"`{' '.join(argv)}` failed on {target} (exit {p.returncode})",
                details={"stdout": (p.stdout or "")[-3000:], "stderr": (p.stderr or "")[-3000:]},
            )
        return p

    def exec_interactive(self, target: str, argv: Sequence[str]) -> int:
        cmd, cg = self.command(target, argv)
        return subprocess.call(cmd, preexec_fn=_join(cg))

    # ------------------------------------------------------------------ up
    def up(
        self,
        nodes: int = 2,
        report: Report = lambda _m: None,
        workload_image: bool = True,
        router: str | None = None,
    ) -> dict[str, Any]:
        names = layout.node_names(nodes)
        notes = preflight.check_host(self.base)
        for n in notes:
            report(n)
        if self.is_up():
            have = self.nodes
            if have != names:
                raise UsageError(
                    f"lab {self.name!r} is already up with {len(have)} nodes, not {nodes}",
                    hint="run `podmigrate lab down` first to change the node count",
                )
            report(f"lab {self.name!r} is already up")
        else:
            if self.dir.exists() or self.cgroup.exists():
                report("removing what a previous lab left behind")
                self.down()
            if not self.image.ready():
                self.image.build(report)
            self.image.configure()
            self._start(names, report)
            report("checking CRIU against this kernel (criu check on node-a)")
            check = self.run(names[0], ["criu", "check"], check=False)
            if check.returncode:
                self.down()
                raise PreflightError(
                    "`criu check` fails on this machine: CRIU cannot checkpoint here",
                    hint="its output is below; the kernel may lack a feature CRIU needs",
                    details={"output": (check.stdout + check.stderr).splitlines()[-20:]},
                )
        if router:
            self.set_router(router)
        if workload_image:
            from podmigrate.workload.image import ensure_workload_image

            ensure_workload_image(self, report)
        return self.status()

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

    def _start(self, names: list[str], report: Report) -> None:
        report(f"starting lab {self.name!r} with nodes {', '.join(names)}")
        self.dir.mkdir(parents=True, exist_ok=True)
        # CRIU's lazy-pages daemon needs 4 MiB pipes and has no CAP_SYS_RESOURCE here; the old value is
        # kept and put back by `lab down` (pipe-max-size is one value for the whole machine)
        # (machine-wide, like the value: the first lab up keeps it, the last one down puts it back)
        pipe_max, orig = Path("/proc/sys/fs/pipe-max-size"), self.base / "pipe-max-size.orig"
        if int(pipe_max.read_text()) < LAZY_PIPE_MAX:
            if not orig.exists():
                orig.write_text(pipe_max.read_text())
            pipe_max.write_text(str(LAZY_PIPE_MAX))
        os.chmod(self.dir, 0o700)  # checkpoints and the token live below
        self.cache.mkdir(parents=True, exist_ok=True)
        for d in ("pids", "agents", "logs", "hold", "registry", "nodes"):
            (self.dir / d).mkdir(exist_ok=True)
        fd = os.open(self.dir / "token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        (self.dir / "registry.yml").write_text(REGISTRY_YML)
        (self.dir / "lab.json").write_text(
            json.dumps(
                {
                    "name": self.name,
                    "nodes": names,
                    "cgroup": layout.cgroup_name(self.name),
                    "created": time.time(),
                    "version": podmigrate.__version__,
                }
            )
        )
        (self.cgroup / "lab").mkdir(parents=True, exist_ok=True)
        pkg = Path(podmigrate.__file__).resolve().parent
        log = open(self.dir / "logs" / "lab.log", "ab")
        proc = subprocess.Popen(
            [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                STAGE1,
                "stage1",
                str(self.image.root),
                str(self.dir),
                str(self.cache),
                str(pkg),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_join(self.cgroup / "lab"),
        )
        log.close()
        (self.dir / "lab.pid").write_text(str(proc.pid))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.is_up():
                return
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = (self.dir / "logs" / "lab.log").read_text(errors="replace").splitlines()[-30:]
        self.down()
        raise LabError(
            f"lab {self.name!r} failed to start",
            details={"log_tail": tail},
            hint="the log tail is above; `podmigrate lab up` again after fixing the cause",
        )

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        pid = self.holder_pid()
        out: dict[str, Any] = {"name": self.name, "up": pid is not None, "state_dir": str(self.dir)}
        if pid is None:
            return out
        cfg = self.config()
        out.update(pid=pid, registry=f"http://{layout.REGISTRY}", nodes=[])
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

    # ------------------------------------------------------------------ down
    def down(self, report: Report = lambda _m: None) -> None:
        cg = self.cgroup
        if cg.exists():
            report(f"stopping every process of lab {self.name!r}")
            (cg / "cgroup.kill").write_text("1")
            # cgroup.procs empties before the tasks are gone; "populated 0" means really gone
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "populated 1" in (cg / "cgroup.events").read_text():
                time.sleep(0.05)
            _reap(self.dir / "lab.pid")
            left = _procs(cg)
            if left:
                raise LabError(f"processes of lab {self.name!r} survived cgroup.kill: {left[:10]}")
            for d in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                _rmdir(d)
            _rmdir(cg)
        orig = self.base / "pipe-max-size.orig"
        if orig.exists() and not any(
            Lab(d.name).is_up() for d in (self.base / "labs").iterdir() if d.name != self.name and _NAME.match(d.name)
        ):
            Path("/proc/sys/fs/pipe-max-size").write_text(orig.read_text())
            orig.unlink()
        if self.dir.exists():
            report(f"removing {self.dir}")
            shutil.rmtree(self.dir)


def _reap(pidfile: Path) -> None:
    """Collect the lab holder's exit status if this process started it (else it stays a zombie)."""
    with contextlib.suppress(OSError, ValueError):
        os.waitpid(int(pidfile.read_text()), os.WNOHANG)


def _rmdir(d: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the kernel finishes tearing the cgroup down
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _procs(cg: Path) -> list[int]:
    pids: list[int] = []
    for f in [cg / "cgroup.procs", *cg.rglob("cgroup.procs")]:
        with contextlib.suppress(OSError):
            pids += [int(x) for x in f.read_text().split()]
    return pids
