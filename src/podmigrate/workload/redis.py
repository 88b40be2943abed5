"""A real server that does not run as root, for the lab: Debian's redis-server in a container whose
image runs it as the package's own ``redis`` user, and a client on the LAN that holds one
connection to it and counts what it acknowledged.

It shows that podmigrate moves processes of any user (issue 31, "any process"): CRIU, run as a root
without CAP_SYS_RESOURCE, must dump and restore a task of another user, which podmigrate's CRIU does
(``lab/criu_patches/0002-*``: rlimits from /proc/PID/limits, restored within reach). The image is
built like the workload image (``workload.image``): a trixie rootfs with the package (mmdebstrap),
then FROM scratch with buildah, both cached in ``$PODMIGRATE_HOME/cache``, copied into the lab's
registry. ``start`` runs it with plain podman, as a user would; the engine moves it like any
hand-made container, probed with ``tcp:6379`` (its port speaks no HTTP).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate import layout
from podmigrate.errors import PodmigrateError
from podmigrate.lab import mirror
from podmigrate.lab.host import join
from podmigrate.lab.image import SUITE
from podmigrate.workload import manage
from podmigrate.workload.image import _part_name, ensure_image, push_archive, rootfs_tar

if TYPE_CHECKING:
    from podmigrate.lab.cluster import Lab, Report

PACKAGES = "redis-server"
REPOSITORY = f"{layout.REGISTRY}/podmigrate/redis"
PORT = 6379
PROBE = f"tcp:{PORT}"
USER = "redis"  # created by the package's postinst: a system uid, never 0
# state in memory only (no RDB, no AOF: CRIU moves the memory); clients come from the LAN, so no
# protected mode
COMMAND = [
    "redis-server",
    "--bind", "0.0.0.0",
    "--port", str(PORT),
    "--protected-mode", "no",
    "--save", "",
    "--appendonly", "no",
    "--daemonize", "no",
]  # fmt: skip
LABELS = {manage.LABEL_KIND: "redis"}  # no manage.LABEL_PORT: the probe it implies is HTTP


def image_tag() -> str:
    return hashlib.sha256(f"{SUITE} {mirror.debian_mirror()} {PACKAGES} {USER} {COMMAND}".encode()).hexdigest()[:12]


def redis_image() -> str:
    return f"{REPOSITORY}:{image_tag()}"


def ensure_redis_image(lab: Lab, report: Report = lambda _m: None) -> str:
    """The image's reference, built (or taken from the cache) and loaded into the lab's registry."""
    return ensure_image(lab, redis_image(), _load, report)


def _load(lab: Lab, ref: str, report: Report) -> None:
    tag = image_tag()
    archive = f"{layout.IN_LAB_CACHE}/redis-{tag}.oci.tar"
    if not (lab.cache / Path(archive).name).exists():
        rootfs = rootfs_tar(lab, "redis-rootfs", PACKAGES, report)
        report("building the redis image with buildah")
        part = _part_name(archive)
        script = f"""set -e
c=$(buildah from scratch)
trap 'buildah rm $c >/dev/null 2>&1 || true; rm -f {part}' EXIT
buildah add $c {rootfs} / >/dev/null
buildah config --user {USER} --cmd '{json.dumps(COMMAND)}' --port {PORT} \
  --label org.opencontainers.image.title=redis $c
buildah commit -q $c localhost/podmigrate-redis:{tag} >/dev/null
buildah push -q localhost/podmigrate-redis:{tag} oci-archive:{part}
buildah rmi localhost/podmigrate-redis:{tag} >/dev/null
mv -f {part} {archive}
"""
        lab.run("node-a", ["sh", "-c", script], timeout=1800)
    push_archive(lab, archive, ref, "redis", report)


def start(lab: Lab, name: str, node: str, report: Report = lambda _m: None) -> str:
    """Run redis ``name`` on ``node`` with plain podman (as its image's user) and route its address
    from the LAN; its address (``answers`` tells when it serves)."""
    image = ensure_redis_image(lab, report)
    labels = [f"--label={k}={v}" for k, v in LABELS.items()]
    lab.run(node, ["podman", "run", "-d", "--name", name, "--network", layout.WORKLOAD_NETWORK, *labels, image])
    ip = manage.locate(lab, name).ips[0]
    manage.set_route(lab, ip, node)
    return ip


def owner(lab: Lab, node: str, name: str) -> dict[str, Any]:
    """The container's main process on ``node``: its pid there, and its uids and gids (real,
    effective, saved, filesystem) from /proc/PID/status."""
    pid = lab.run(node, ["podman", "inspect", "-f", "{{.State.Pid}}", name]).stdout.strip()
    status = lab.run(node, ["cat", f"/proc/{pid}/status"]).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "pid": int(pid),
        "uids": [int(x) for x in fields["Uid"].split()],
        "gids": [int(x) for x in fields["Gid"].split()],
    }


# The LAN side. Standard library only (the lab's python3): one connection, INCR on one key as fast as
# the replies come, every reply checked to be the previous one plus one (a lost or repeated write
# shows at once); progress as JSON lines, and on EOF of stdin the end: no more commands, the
# connection's redis client id asked again, the last acknowledged value. It never reconnects: a
# broken connection ends it with the error.
CLIENT = r"""
import json, socket, sys, threading, time
host, port, key = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n"); sys.stdout.flush()
s = socket.create_connection((host, port), timeout=60)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
f = s.makefile("rb")
def call(*args):
    s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in (x.encode() for x in args)))
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise EOFError("connection closed")
    if line[:1] == b"-":
        raise RuntimeError(line.decode().strip())
    if line[:1] == b"$":
        return f.read(int(line[1:]) + 2)[:-2].decode()
    return line[1:-2].decode()
local = "%s:%d" % s.getsockname()[:2]
say(event="connected", client_id=int(call("CLIENT", "ID")), local=local)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
last, acks, wrong, gap, broken = 0, 0, [], 0.0, None
t_last = t_said = time.monotonic()
while not stop.is_set():
    try:
        v = int(call("INCR", key))
    except Exception as e:
        broken = repr(e)
        break
    now = time.monotonic()
    gap, t_last = max(gap, now - t_last), now
    if v != last + 1:
        wrong.append([last, v])
    last, acks = v, acks + 1
    if now - t_said >= 0.1:
        say(event="progress", last=last, acks=acks)
        t_said = now
end = dict(event="end", last=last, acks=acks, wrong=wrong[:20], max_gap=round(gap, 3), broken=broken, local=local)
if broken is None:
    end["client_id"] = int(call("CLIENT", "ID"))
say(**end)
"""


@dataclass
class Client:
    """``CLIENT`` running in the lab's LAN against ``host``: its lines as they come."""

    lab: Lab
    host: str
    key: str
    lines: list[dict[str, Any]] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self) -> Client:
        cmd, cgroup = self.lab.command("lan", ["python3", "-u", "-c", CLIENT, self.host, str(PORT), self.key])
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=join(cgroup)
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def last(self, event: str) -> dict[str, Any] | None:
        return next((x for x in reversed(self.lines) if x["event"] == event), None)

    def acked(self) -> int:
        """The last value acknowledged so far (0 before the first)."""
        p = self.last("progress")
        return int(p["last"]) if p else 0

    def finish(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop sending (after the reply in flight) and return the client's end line."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout)
        end = self.last("end")
        if end is None:
            raise PodmigrateError(f"the redis client ended with exit {self.proc.returncode} and no result")
        return end

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# One command on a fresh connection from the LAN, its reply printed as JSON (null for nil).
ASK = r"""
import json, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
args = [a.encode() for a in sys.argv[3:]]
s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
f = s.makefile("rb")
line = f.readline()
if line[:1] == b"$":
    n = int(line[1:])
    print(json.dumps(None if n < 0 else f.read(n + 2)[:-2].decode()))
elif line[:1] in (b"+", b":"):
    print(json.dumps(line[1:-2].decode()))
else:
    sys.exit("redis said: %r" % line)
"""


def ask(lab: Lab, host: str, *args: str) -> Any:
    """One command to redis at ``host`` on a connection of its own; its reply (None for nil)."""
    p = lab.run("lan", ["python3", "-c", ASK, host, str(PORT), *args], check=False, timeout=30)
    if p.returncode:
        raise PodmigrateError(f"redis at {host} did not answer {' '.join(args)}: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def answers(lab: Lab, host: str) -> bool:
    """Whether redis at ``host`` answers PING (for polling until it serves)."""
    try:
        return bool(ask(lab, host, "PING") == "PONG")
    except PodmigrateError:
        return False
