"""The speculative restore (Podman backend): the target's podman and runc do their part of a restore
before the source is frozen, and wait at a gate in front of CRIU until the real images are there.

Everything podman and runc do before CRIU (podman's start, database, storage, netavark, conmon;
runc's start, its CRIU checks, cgroups, the root and its mounts: 0.12-0.16 s of every restore here)
needs only what exists before the freeze: the container's configuration (podman's
``ContainerConfig``, ``config.dump`` in an export), its OCI spec (``spec.dump``), its addresses
(``network.status``) and standard descriptors (runc's ``descriptors.json``). The source reads them
(``read_config``, ``read_descriptors``); the target imports them as a checkpoint whose image
directory holds a gate token and an empty inventory (podman only checks that one exists)
(``start``). The node's ``criu`` first in the PATH is a gate (``criu_gate``, installed by
``lab.image``): every run is the node's CRIU's (``lab.criu_build``'s where the image has it), but
when runc restores from an image directory that holds a token, it waits on that gate's FIFO. When
the real images arrive, ``Gate.place`` puts them, the root file system's last changes and /dev/shm
where podman's import would have, and ``Gate.release`` lets CRIU run; ``Gate.cancel`` makes the gate
exit 1, so that runc's and podman's restore fail, and removes what they left. Standard library only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from podmigrate.errors import RuntimeBackendError
from podmigrate.runtime.criu_conf import CRIU_CONF, CRIU_RUNS, RUN_ENV, CriuRun

GATES = Path("/run/podmigrate/gates")
TOKEN = "podmigrate-gate"  # in the image directory: this restore waits at the gate
CRIU_GATE_PATH = "/usr/local/sbin/criu"  # first in the PATH runc finds criu in
PODMAN_DB = Path("/var/lib/containers/storage/db.sql")
RUNC_STATE = Path("/run/runc")  # podman's runc root: <id>/state.json
_CRIU_GATE = """#!/bin/sh
# podmigrate's criu (podmigrate.runtime.speculative), first in the PATH: every run is @CRIU@'s, but
# when runc restores a checkpoint whose image directory holds a gate token, it waits for the node
# agent's word first. runc has that directory open (CRIU opens it through /proc/<runc>/fd) and by
# now has done its own part: its checks, cgroups, the root and the mounts, descriptors.json read.
if [ "$1" = swrk ] && read -r comm </proc/$PPID/comm && [ "$comm" = @PARENT@ ]; then
  for f in /proc/$PPID/fd/*; do
    [ -f "$f/@TOKEN@" ] || continue
    img=$(readlink "$f") && gate=@GATES@/$(tr -cd 'A-Za-z0-9_.-' <"$f/@TOKEN@") || exit 1
    [ -p "$gate.fifo" ] || exit 1
    # the FIFO is open for reading before the restore is said to wait: from then on the agent's
    # death (its end closes) ends the wait with EOF; 300 s end a forgotten one
    verdict=$(timeout 300 sh -c 'exec 3<"$1" && printf "%s\\n%s\\n" "$2" "$3" >"$4.tmp" && mv "$4.tmp" "$4.waiting" &&
      head -n1 <&3' sh "$gate.fifo" "$img" "${img%/*}" "$gate")
    [ "$verdict" = go ] || exit 1
    break
  done
fi
# a run with CRIU options of its own (podmigrate.runtime.criu_conf): CRIU reads them where runc
# tells it to read the node's configuration, bound over it in a mount namespace of its own. A
# restore's file is named in the environment (conmon hands it on); podman gives runc's checkpoints
# no environment of ours, so a checkpoint's is named by the container's ID, runc's last argument.
conf=${@ENV@:-}
if [ "$1" = swrk ] && [ -z "$conf" ] && read -r comm </proc/$PPID/comm && [ "$comm" = @PARENT@ ]; then
  id=$(tr '\\0' '\\n' </proc/$PPID/cmdline | tail -n1 | tr -cd 'A-Za-z0-9')
  [ -n "$id" ] && conf=@RUNS@/id-$id.conf
fi
if [ "$1" = swrk ] && [ -n "$conf" ] && [ -f "$conf" ]; then
  exec unshare --mount --propagation private sh -c 'mount --bind "$1" "$2" && shift 2 && exec "$@"' \\
    sh "$conf" @RUNC_CONF@ @CRIU@ "$@"
fi
exec @CRIU@ "$@"
"""


def criu_gate(
    gates: Path = GATES,
    criu: str = "/usr/sbin/criu",
    parent: str = "runc",
    runc_conf: Path = CRIU_CONF,
    runs: Path = CRIU_RUNS,
) -> str:
    """The gate's text: its gates' directory, the criu it runs, the parent whose runs it holds or
    configures, the configuration file runc hands CRIU and where the runs' own files are."""
    return (
        _CRIU_GATE.replace("@TOKEN@", TOKEN)
        .replace("@GATES@", str(gates))
        .replace("@CRIU@", criu)
        .replace("@PARENT@", parent)
        .replace("@ENV@", RUN_ENV)
        .replace("@RUNC_CONF@", str(runc_conf))
        .replace("@RUNS@", str(runs))
    )


CRIU_GATE = criu_gate()


def export_config(config: dict[str, Any]) -> dict[str, Any]:
    """Podman's ``ContainerConfig`` as its export writes it into config.dump: the container's short
    ID left out of the networks' aliases, since a restored copy may get a new ID (libpod's
    ``prepareCheckpointExport``)."""
    out = dict(config)
    short = str(config.get("id", ""))[:12]
    nets = {}
    for net, opts in (config.get("newNetworks") or {}).items():
        opts = dict(opts)
        aliases = [a for a in opts.get("aliases") or [] if a != short]
        if aliases:
            opts["aliases"] = aliases
        else:
            opts.pop("aliases", None)
        nets[net] = opts
    if nets:
        out["newNetworks"] = nets
    return out


class Gate:
    """One speculative restore: podman's process, the gate's FIFO (held open here) and, once podman
    is there, the image directory and bundle the gate reported."""

    def __init__(
        self,
        token: str,
        name: str,
        proc: subprocess.Popen[str],
        started: float,
        gates: Path = GATES,
        criu: CriuRun | None = None,
    ):
        self.token, self.name, self.proc, self.started, self.gates = token, name, proc, started, gates
        self.criu = criu  # the CRIU options file its podman was started with (``criu_conf``)
        self.fifo = gates / f"{token}.fifo"
        self.fd = os.open(self.fifo, os.O_RDWR)  # never blocks; its close is the waiter's EOF
        self.img: Path | None = None
        self.bundle: Path | None = None
        self.reached: float | None = None
        self.released = self.cancelled = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> None:
        """Until podman waits at the gate; an error with podman's words if it ended or took too long."""
        waiting = self.gates / f"{self.token}.waiting"
        deadline = time.monotonic() + timeout
        while not waiting.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                ended = self.proc.poll() is not None
                err = self.proc.stderr.read() if ended and self.proc.stderr else ""
                why = f"podman exited {self.proc.returncode}" if ended else f"not there after {timeout:.0f} s"
                raise RuntimeBackendError(
                    f"the speculative restore of {self.name} did not reach its gate ({why}): {err.strip()[-300:]}"
                )
            time.sleep(0.002)
        img, bundle = waiting.read_text().splitlines()[:2]
        self.img, self.bundle, self.reached = Path(img), Path(bundle), time.time()

    def place(self, archive: Path) -> None:
        """Put the checkpoint in ``archive`` where podman's import would have: the CRIU images into
        the image directory, the root file system's changes and deleted files into the mounted root,
        /dev/shm's contents into the container's shm directory."""
        assert self.img is not None and self.bundle is not None
        staging = self.bundle / "podmigrate-staging"  # same file system as the image directory
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o700)
        try:
            p = subprocess.run(["tar", "-C", str(staging), "-xf", str(archive)], capture_output=True, text=True)
            if p.returncode:
                raise RuntimeBackendError(f"unpacking the checkpoint at the gate failed: {p.stderr.strip()}")
            for f in (staging / "checkpoint").iterdir():
                os.replace(f, self.img / f.name)
            (self.img / TOKEN).unlink(missing_ok=True)
            spec = json.loads((self.bundle / "config.json").read_text())
            root = Path(spec["root"]["path"])
            diff, gone = staging / "rootfs-diff.tar", staging / "deleted.files"
            deleted = [str(x) for x in json.loads(gone.read_text())] if gone.exists() else []
            if diff.exists() or deleted:  # the archive is opened here: the chroot cannot see it
                with open(diff, "rb") if diff.exists() else contextlib.nullcontext() as changed:
                    within(root, lambda: _apply(changed, deleted), "the root file system's changes")
            shm = staging / "devshm-checkpoint.tar"
            shm_dir = json.loads((staging / "config.dump").read_text()).get("ShmDir") if shm.exists() else None
            if shm_dir and Path(shm_dir).is_dir():
                with open(shm, "rb") as contents:
                    within(Path(shm_dir), lambda: _apply(contents, []), "/dev/shm's contents")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def release(self) -> None:
        # from here the restore is CRIU's: what it leaves is a failed restore's, not an orphan's
        (self.gates / f"{self.token}.name").unlink(missing_ok=True)
        self.released = True
        os.write(self.fd, b"go\n")

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        """podman's exit and error output once runc and CRIU are done (after ``release``)."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self._close()
        return self.proc.returncode, err or ""

    def cancel(self) -> None:
        """Make the waiting restore fail and remove the container it created (once; again is a no-op)."""
        if self.cancelled:
            return
        self.cancelled = True
        if not self.released:
            with contextlib.suppress(OSError):
                os.write(self.fd, b"cancel\n")
        try:
            self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        self._close()
        if not self.released and self.name:
            # podman leaves it created, or only its storage when it failed before its database
            for args in (["rm", "-f", "-t", "0"], ["rm", "--storage"]):
                subprocess.run(["podman", *args, "--", self.name], capture_output=True)

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        _remove(self.gates, self.token)
        if self.criu:
            self.criu.remove()


def _remove(gates: Path, token: str) -> None:
    """A gate's files: its FIFO, the waiting mark, a placing's leftovers, the container's name."""
    for suffix in (".fifo", ".waiting", ".tmp", ".name"):
        (gates / f"{token}{suffix}").unlink(missing_ok=True)


def orphans(gates: Path = GATES) -> list[str]:
    """The tokens of restores that an agent started and never released nor cancelled: it died (a
    live agent's own gates are in its memory, and ``start`` and ``release`` keep the name file only
    in between)."""
    return sorted(p.name.removesuffix(".name") for p in gates.glob("*.name")) if gates.is_dir() else []


def clean_orphan(token: str, gates: Path = GATES) -> str | None:
    """Remove what a dead agent's waiting restore left: its gate's files and, unless it runs, the
    container podman created for it (the gate read EOF when the agent died, so runc and podman failed
    and left it created). Returns the container's name, None when there was no such restore."""
    try:
        name = (gates / f"{token}.name").read_text().strip()
    except OSError:
        return None
    if name:
        state = subprocess.run(
            ["podman", "inspect", "-f", "{{.State.Running}}", "--", name], capture_output=True, text=True
        )
        if state.stdout.strip() != "true":
            for args in (["rm", "-f", "-t", "0"], ["rm", "--storage"]):
                subprocess.run(["podman", *args, "--", name], capture_output=True)
    _remove(gates, token)
    return name


def within(root: Path, work: Callable[[], None], what: str) -> None:
    """Run ``work`` in a child process chrooted into ``root``. The paths a checkpoint names (its
    changed and deleted files) come from the workload, whose root may hold symbolic links to
    anywhere: resolved inside the chroot, none of them reaches the node. A forked child, not a new
    interpreter: this is inside the blackout, and ``work`` only needs what is loaded already."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 1
        try:
            os.close(r)
            os.chroot(root)
            os.chdir("/")
            work()
            code = 0
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.write(w, f"{type(e).__name__}: {e}".encode()[-500:])
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeBackendError(f"applying {what} at the gate failed: {err or 'exit ' + str(status)}")


def _apply(tar: IO[bytes] | None, deleted: list[str]) -> None:
    """Inside the chroot (``within``): extract ``tar`` (opened before the chroot) as podman's import
    does (owners, modes and times kept) and remove the ``deleted`` paths."""
    if tar is not None:
        with tarfile.open(fileobj=tar) as t:
            t.extractall("/", numeric_owner=True, filter="fully_trusted")
    for path in deleted:
        target = "/" + path.lstrip("/")
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)


def read_descriptors(container_id: str, runc_state: Path = RUNC_STATE) -> list[str]:
    """The container's standard descriptors as runc keeps them (``external_descriptors``), which its
    dump writes into descriptors.json and a restore hands to CRIU as inherited pipes."""
    try:
        fds = json.loads((runc_state / container_id / "state.json").read_text())["external_descriptors"]
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeBackendError(f"reading runc's state of {container_id[:12]} failed: {e}") from e
    if not isinstance(fds, list) or not all(isinstance(x, str) for x in fds):
        raise RuntimeBackendError(f"runc's state of {container_id[:12]} has no descriptors list")
    return fds


def _podman_db() -> contextlib.closing[sqlite3.Connection]:
    """podman's database, read-only: read without podman's locks."""
    return contextlib.closing(sqlite3.connect(f"file:{PODMAN_DB}?mode=ro", uri=True, timeout=5))


def container_ids() -> list[str] | None:
    """The IDs of every container in podman's database (None: no database here, or it cannot be read)."""
    try:
        with _podman_db() as db:
            return [str(r[0]) for r in db.execute("SELECT ID FROM ContainerConfig")]
    except sqlite3.Error:
        return None


def read_config(container_id: str) -> dict[str, Any]:
    """Podman's configuration of a container, from its database, as an export writes it."""
    try:
        with _podman_db() as db:
            row = db.execute("SELECT JSON FROM ContainerConfig WHERE ID = ?", (container_id,)).fetchone()
    except sqlite3.Error as e:
        raise RuntimeBackendError(f"reading podman's database failed: {e}") from e
    if row is None:
        raise RuntimeBackendError(f"podman's database has no configuration for {container_id[:12]}")
    return export_config(json.loads(row[0]))


def start(token: str, skeleton: dict[str, Any], where: Path, *, tcp_established: bool = True) -> Gate:
    """Start podman's restore of ``skeleton`` (its archive written to ``where``); it stops at the
    gate named ``token``, where the caller waits for it (``Gate.wait``)."""
    GATES.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove(GATES, token)
    os.mkfifo(GATES / f"{token}.fifo", 0o600)
    # for the next agent, should this one die before the gate opens (``clean_orphan``)
    (GATES / f"{token}.name").write_text(str(skeleton["config"].get("name") or ""))
    with tarfile.open(where, "w") as t:
        os.chmod(where, 0o600)  # the configuration may hold the container's secrets (its environment)
        for member, data in (
            ("config.dump", json.dumps(skeleton["config"]).encode()),
            ("spec.dump", json.dumps(skeleton["spec"]).encode()),
            ("network.status", json.dumps(skeleton["network"]).encode()),
            (f"checkpoint/{TOKEN}", token.encode()),
            ("checkpoint/inventory.img", b""),
            # read by runc before CRIU starts: the container's standard descriptors, as its dump writes them
            ("checkpoint/descriptors.json", json.dumps(skeleton["descriptors"]).encode()),
        ):
            info = tarfile.TarInfo(member)
            info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
            t.addfile(info, io.BytesIO(data))
    args = ["podman", "container", "restore", "--import", str(where)]
    if tcp_established:
        args.append("--tcp-established")
    started = time.time()
    # CRIU reads its options when the gate lets it run: ``lazy.lazy_restore`` writes them then
    criu = CriuRun(f"gate-{token}")
    # its own process group, as every podman that may be left waiting
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=criu.env
    )
    try:
        return Gate(token, str(skeleton["config"].get("name") or ""), proc, started, criu=criu)
    except OSError:
        proc.kill()
        proc.communicate()
        criu.remove()
        raise
