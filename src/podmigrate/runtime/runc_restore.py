#!/usr/bin/python3
"""podmigrate-runc: the OCI runtime of the ``podmigrate`` RuntimeClass. runc, except that a container
the podmigrate node agent has prepared a checkpoint for is restored instead of created fresh.

A restore that works where the runtime's own is gone (containerd 2.4+ removed CRI restore; CRI-O
ships it off): the kubelet creates the copy as a normal pod with its original images, the runtime
class ``podmigrate`` and pod annotations (which containerd passes into each container's OCI spec when
the handler allow-lists them: ``pod_annotations = ["io.podmigrate.*"]``)::

    io.podmigrate.restore                  = "server,sidecar"     the containers to restore
    io.podmigrate.restore-from.<container> = /var/lib/podmigrate/restore/<migration>/<container>
    io.podmigrate.tcp-established          = "true"               optional: restore open connections
    io.podmigrate.stream                   = "server"             streamed: wait for the checkpoint here
    io.podmigrate.wait-seconds             = "90"                 how long a streamed restore waits
    io.podmigrate.lazy                     = "server"             post-copy: its pages come as it runs

The directory holds the checkpoint archive unpacked (``checkpoint/`` = CRIU's images, optionally
``rootfs-diff.tar``) and the agent's ``podmigrate-verified.json``, written only after the image's
digest was checked. On ``create`` the wrapper applies the root-filesystem diff to the new bundle and
runs ``runc restore --detach --no-subreaper`` with the shim's stdio (runc maps the checkpoint's pipes
onto them) and pid file: the same call containerd's shim makes for its own restore. ``start`` of a
restored container is then a no-op. Everything else goes to runc unchanged.

It fails loudly, never silently fresh: a container named in ``io.podmigrate.restore`` whose
``restore-from`` is missing, outside the restore directory, or unverified is refused with the reason,
which reaches the CRI error through runc's ``--log`` file. A container is restored at most once per
sandbox (a restart after that starts it fresh, as the kubelet expects of a restart).

A **streamed** restore (``io.podmigrate.stream``) is created before the source is frozen: ``create``
starts a CRIU page server writing into ``restore-from/checkpoint``, says its port in
``page-server.json`` (the node agent relays the source's dump to it, sealed, between the nodes), and
waits for the agent's ``podmigrate-verified.json`` (the rest of the checkpoint is in) or its ``abort``
(the migration rolled back) before it restores. The pod's sandbox, image and container setup are
then behind the copy before the freeze, not in its blackout. The restore leaves the memory in those
images: a local ``criu lazy-pages`` daemon (its pid in ``lazy-daemon.pid``, its log beside it) copies
it in while the copy already runs, so the blackout does not read the whole heap.

Standard library only (it runs on the node with the system python3). Configuration (optional):
``/etc/podmigrate/runc-restore.json`` ``{"runc": "/usr/sbin/runc", "criu": "criu", "state":
"/run/podmigrate-runc", "restore_dir": "/var/lib/podmigrate/restore"}``.
"""

from __future__ import annotations

# The shim runs this for every runc command, two of them (a restored container's create and the
# start before it) inside a migration's blackout: only what every command needs is imported here,
# the rest where it is used (a third of the time a call took went to imports).
import json
import os
import sys
import time
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

CONFIG = Path("/etc/podmigrate/runc-restore.json")
DEFAULTS = {
    "runc": "/usr/sbin/runc",
    "criu": "criu",
    "state": "/run/podmigrate-runc",
    "restore_dir": "/var/lib/podmigrate/restore",
}
GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu", "--rootless"}
CREATE_WITH_VALUE = {"--bundle", "-b", "--pid-file", "--console-socket", "--preserve-fds"}
PREFIX = "io.podmigrate."
VERIFIED = "podmigrate-verified.json"


class Refused(Exception):
    """The container cannot be restored; the message says why."""


def config() -> dict[str, str]:
    try:
        return {**DEFAULTS, **json.loads(CONFIG.read_text())}
    except FileNotFoundError:
        return dict(DEFAULTS)


def parse(argv: list[str]) -> tuple[list[str], str, dict[str, str | bool], str]:
    """runc's argv -> (global options, command, the command's options, container id)."""
    glob: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        glob.append(argv[i])
        if argv[i] in GLOBAL_WITH_VALUE and i + 1 < len(argv):
            glob.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        return glob, "", {}, ""
    cmd, rest = argv[i], argv[i + 1 :]
    opts: dict[str, str | bool] = {}
    j = 0
    while j < len(rest) - 1:  # the last argument is the container id
        a = rest[j]
        if "=" in a and a.startswith("--"):
            key, value = a.split("=", 1)
            opts[key] = value
        elif a in CREATE_WITH_VALUE:
            opts[a] = rest[j + 1]
            j += 1
        else:
            opts[a] = True
        j += 1
    return glob, cmd, opts, rest[-1] if rest else ""


def _log_path(glob: list[str]) -> str | None:
    if "--log" in glob[:-1]:
        return glob[glob.index("--log") + 1]
    return next((g.split("=", 1)[1] for g in glob if g.startswith("--log=")), None)


def fail(glob: list[str], state: Path, message: str) -> NoReturn:
    """Exit non-zero with ``message`` where the shim looks for runc's reason (the JSON log's last error)."""
    message = f"podmigrate-runc: {message}"
    log = _log_path(glob)
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"level": "error", "msg": message, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ")}) + "\n")
    note(state, message)
    print(message, file=sys.stderr)
    sys.exit(1)


def note(state: Path, line: str) -> None:
    from datetime import datetime

    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(state / "podmigrate-runc.log", "a") as f:
        f.write(f"{datetime.now().isoformat(timespec='milliseconds')} {line}\n")  # a blackout's steps are ms


def restore_source(annotations: dict[str, str], restore_dir: Path) -> Path | None:
    """The verified checkpoint directory this container is to be restored from, None for a fresh start."""
    if annotations.get("io.kubernetes.cri.container-type") == "sandbox":
        return None
    name = annotations.get("io.kubernetes.cri.container-name", "")
    wanted = [c.strip() for c in annotations.get(PREFIX + "restore", "").split(",") if c.strip()]
    src = annotations.get(f"{PREFIX}restore-from.{name}") or annotations.get(PREFIX + "restore-from")
    if not src:
        if name in wanted:
            raise Refused(
                f"the pod asks to restore container {name!r} ({PREFIX}restore) but no {PREFIX}restore-from.{name} "
                "reached the runtime: check the pod's annotations and the handler's pod_annotations allow-list"
            )
        return None
    path = Path(os.path.realpath(src))
    if path.parent.parent != Path(os.path.realpath(restore_dir)):
        raise Refused(f"{src} is not a checkpoint directory under {restore_dir}; refusing to restore from it")
    if not (path / VERIFIED).is_file():
        raise Refused(f"{src} has no {VERIFIED}: the node agent has not fetched and verified this checkpoint")
    if not (path / "checkpoint" / "descriptors.json").is_file():
        raise Refused(f"{src}/checkpoint has no descriptors.json: not a runc checkpoint")
    return path


def pending_source(annotations: dict[str, str], restore_dir: Path) -> Path:
    """A streamed restore's directory, before its checkpoint is in: under the restore directory, or refused."""
    name = annotations.get("io.kubernetes.cri.container-name", "")
    src = annotations.get(f"{PREFIX}restore-from.{name}") or ""
    path = Path(os.path.realpath(src)) if src else None
    if path is None or path.parent.parent != Path(os.path.realpath(restore_dir)) or not path.is_dir():
        raise Refused(f"a streamed restore needs {PREFIX}restore-from.{name} naming a directory the node agent "
                      f"made under {restore_dir}, not {src!r}")  # fmt: skip
    return path


def apply_rootfs_diff(src: Path, rootfs: Path) -> None:
    """The container's writes to its root filesystem, on top of the fresh snapshot of its image."""
    diff = src / "rootfs-diff.tar"
    if not diff.exists():
        return
    import tarfile

    with tarfile.open(diff, "r:*") as t:  # containerd's is gzip despite the name, Podman's plain
        for m in t.getmembers():
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise Refused(f"{diff}: member {m.name!r} leaves the root filesystem")
        t.extractall(rootfs, filter="tar")


def wait_for_stream(
    glob: list[str], state: Path, src: Path, wait: float, criu: str, lazy: bool = False, pod_ip: str | None = None
) -> None:
    """Serve the dump's pages into ``src/checkpoint`` and wait for the agent to verify the rest;
    ``lazy``: no page server (the pages stay with the source until the copy asks), only the wait.
    ``pod_ip``: the sandbox's address, for the agent to see the copy serve before the kubelet does."""
    import socket
    import subprocess

    images = src / "checkpoint"
    images.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = None
    for _ in range(0 if lazy else 5):  # a port taken between choosing and binding it: choose again
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = subprocess.Popen(
            [criu, "page-server", "-D", str(images), "--address", "127.0.0.1", "--port", str(port),
             "-o", "page-server.log", "-v2"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        until = time.monotonic() + 10
        while server.poll() is None and time.monotonic() < until and not _listening(port):
            time.sleep(0.01)
        if server.poll() is None and _listening(port):
            break
        server.kill()
        server.wait()
        server = None
    if server is None and not lazy:
        fail(glob, state, f"criu page-server did not start for {src}: {_tail(images / 'page-server.log')}")
    tmp = src / "page-server.json.tmp"
    info: dict[str, Any] = {"port": port, "pid": server.pid} if server else {"port": None, "lazy": True}
    tmp.write_text(json.dumps({**info, "pod_ip": pod_ip}))
    tmp.chmod(0o600)
    tmp.rename(src / "page-server.json")  # the agent reads it whole or not at all
    until = time.monotonic() + wait
    while not (src / VERIFIED).is_file():
        if (src / "abort").exists() or time.monotonic() > until:
            if server is not None:
                server.kill()
                server.wait()
            why = "the migration was rolled back" if (src / "abort").exists() else f"nothing came in {wait:.0f} s"
            fail(glob, state, f"streamed restore from {src} did not happen: {why}")
        time.sleep(0.005)
    if server is None:
        return
    try:
        server.wait(timeout=10)  # it ends when the dump's connection closes, before the agent verifies
    except subprocess.TimeoutExpired:
        server.kill()
        fail(glob, state, f"criu page-server for {src} did not finish: {_tail(images / 'page-server.log')}")
    if server.returncode != 0:
        fail(glob, state, f"criu page-server for {src} failed: {_tail(images / 'page-server.log')}")


def lazy_daemon(src: Path, work: Path, criu: str, port: int | None = None) -> bool:
    """``criu lazy-pages`` for a restore that runs before its memory is in: from the source through the
    agent's relay at ``port`` (post-copy), or, without one, from the images a streamed dump's page
    server wrote here (the lab engine's stream restore). It outlives this process and ends when every
    page has moved; its pid in ``lazy-daemon.pid`` (the agent wakes the faults it drops, waits for its
    end), its log beside it. False when it does not start."""
    import subprocess

    remote = ["--page-server", "--address", "127.0.0.1", "--port", str(port)] if port is not None else []
    daemon = subprocess.Popen(
        [criu, "lazy-pages", *remote, "-D", str(src / "checkpoint"), "-W", str(work),
         "-o", str(src / "lazy-pages.log"), "-v2"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    until = time.monotonic() + 30
    while not (work / "lazy-pages.socket").exists():
        if daemon.poll() is not None or time.monotonic() > until:
            daemon.kill()
            daemon.wait()
            return False
        time.sleep(0.005)
    (src / "lazy-daemon.pid").write_text(str(daemon.pid))
    return True


def pod_ip(spec: dict[str, Any]) -> str | None:
    """The first global IPv4 address in the container's network namespace (the pod's: the sandbox
    made it); None where it cannot be read (the operator then waits for the kubelet's status)."""
    path = next(
        (n.get("path") for n in (spec.get("linux") or {}).get("namespaces") or [] if n.get("type") == "network"), None
    )
    if not path:
        return None
    import subprocess

    try:
        p = subprocess.run(["nsenter", f"--net={path}", "ip", "-j", "-4", "addr", "show", "scope", "global"],
                           capture_output=True, text=True, timeout=5)  # fmt: skip
        links = json.loads(p.stdout) if p.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return next((str(a["local"]) for link in links for a in link.get("addr_info") or [] if a.get("local")), None)


def _served(src: Path) -> bool:
    try:
        return bool(json.loads((src / "page-server.json").read_text()).get("port"))
    except (OSError, ValueError, AttributeError):
        return False


def _listening(port: int) -> bool:
    """Read from /proc, never by connecting: the page server takes one connection, the dump's."""
    suffix = f":{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(x.split()[1].endswith(suffix) and x.split()[3] == "0A" for x in f.readlines()[1:])


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"no {path.name}"
    return lines[-1].strip() if lines else f"{path.name} is empty"


def create(argv: list[str], glob: list[str], opts: dict[str, str | bool], cid: str, cfg: dict[str, str]) -> int:
    state = Path(cfg["state"])
    bundle = Path(str(opts.get("--bundle") or opts.get("-b") or "."))
    spec: dict[str, Any] = json.loads((bundle / "config.json").read_text())
    annotations: dict[str, str] = spec.get("annotations") or {}
    name = annotations.get("io.kubernetes.cri.container-name", "")
    sandbox = annotations.get("io.kubernetes.cri.sandbox-id", "")
    once = state / "once" / f"{sandbox}.{name}"
    if name and once.exists():  # before anything else: its checkpoint directory is gone by now
        note(state, f"{cid}: {name} was restored in this sandbox already; a restart starts fresh")
        os.execv(cfg["runc"], [cfg["runc"], *argv])
    sandboxed = annotations.get("io.kubernetes.cri.container-type") == "sandbox"
    streamed = bool(name) and not sandboxed and name in annotations.get(PREFIX + "stream", "").split(",")
    lazy = streamed and name in annotations.get(PREFIX + "lazy", "").split(",")
    if streamed:
        try:
            wait = float(annotations.get(PREFIX + "wait-seconds", "90"))
        except ValueError:
            fail(glob, state, f"{PREFIX}wait-seconds is not a number of seconds")
        try:
            pending = pending_source(annotations, Path(cfg["restore_dir"]))
        except Refused as e:
            fail(glob, state, str(e))
        if not (pending / VERIFIED).exists():
            wait_for_stream(glob, state, pending, wait, cfg["criu"], lazy, pod_ip(spec))
            note(state, f"{cid}: the checkpoint of {name} came in and was verified")
    try:
        src = restore_source(annotations, Path(cfg["restore_dir"]))
    except Refused as e:
        fail(glob, state, str(e))
    if src is None:
        os.execv(cfg["runc"], [cfg["runc"], *argv])
    import subprocess
    import tarfile

    try:
        apply_rootfs_diff(src, bundle / str((spec.get("root") or {}).get("path", "rootfs")))
    except (Refused, OSError, tarfile.TarError) as e:
        fail(glob, state, f"applying {src}/rootfs-diff.tar: {e}")
    work = state / cid / "work"
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    if lazy:
        port = int(json.loads((src / "lazy.json").read_text())["port"])  # the agent's end of the relay
        if not lazy_daemon(src, work, cfg["criu"], port):
            fail(glob, state, f"criu lazy-pages did not start for {src}: {_tail(src / 'lazy-pages.log')}")
    # pages a page server wrote (a container dumped whole brings few, and restores them at once)
    local = streamed and not lazy and _served(src) and lazy_daemon(src, work, cfg["criu"])
    argv = [cfg["runc"], *glob, "restore", "--detach", "--no-subreaper", "--bundle", str(bundle),
            "--image-path", str(src / "checkpoint"), "--work-path", str(work)]  # fmt: skip
    for flag in ("--pid-file", "--console-socket"):
        if opts.get(flag):
            argv += [flag, str(opts[flag])]
    if opts.get("--no-pivot"):
        argv.append("--no-pivot")
    if annotations.get(PREFIX + "tcp-established") == "true":
        argv.append("--tcp-established")
    if lazy or local:
        argv.append("--lazy-pages")
    elif streamed:  # its images are this restore's alone: what is read is freed at once, for the heap
        argv.append("--auto-dedup")
    t0 = time.monotonic()
    rc = subprocess.run([*argv, cid]).returncode  # stdio inherited: runc hands the shim's pipes to CRIU
    if rc != 0:
        fail(glob, state, f"runc restore from {src} failed (exit {rc}): {_criu_error(work)}")
    once.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    once.touch()
    (state / cid / "restored").write_text(json.dumps({"from": str(src), "seconds": time.monotonic() - t0}))
    note(state, f"{cid}: restored from {src} in {time.monotonic() - t0:.3f} s")
    return 0


def _criu_error(work: Path) -> str:
    """CRIU's first real error line from restore.log (its RLIMIT_NOFILE complaint is noise here)."""
    try:
        lines = (work / "restore.log").read_text(errors="replace").splitlines()
    except OSError:
        return "no restore.log"
    errors = [ln.strip() for ln in lines if "Error (" in ln and "RLIMIT_NOFILE" not in ln]
    return errors[0] if errors else (lines[-1].strip() if lines else "restore.log is empty")


def main(argv: list[str]) -> int:
    cfg = config()
    glob, cmd, opts, cid = parse(argv)
    state = Path(cfg["state"])
    if cmd == "create":
        return create(argv, glob, opts, cid, cfg)
    if cmd == "start" and (state / cid / "restored").exists():
        return 0  # restore --detach left it running
    if cmd == "delete" and cid:
        import shutil

        shutil.rmtree(state / cid, ignore_errors=True)
        for marker in (state / "once").glob(f"{cid}.*") if (state / "once").exists() else []:
            marker.unlink(missing_ok=True)  # the sandbox is gone: its restore-once markers with it
    os.execv(cfg["runc"], [cfg["runc"], *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
