"""The node agent's side of a streamed migration on Kubernetes: runc's own checkpoint on the source,
its pages into the target's waiting copy during the dump.

The kubelet's Checkpoint API writes a tar of the whole checkpoint and nothing else; here the source
agent runs ``runc checkpoint --page-server`` itself (in the node's mount namespace, entered through
the container's shim: it needs ``hostPID`` and privileges, ``deploy/kubernetes/stream``) while the
copy's pod already waits on the target (``runtime.runc_restore``: its container's ``create`` serves a
CRIU page server and waits for the rest). Two sealed channels per container, both
``transport.pagerelay`` (AES-256-GCM with the migration's key, only the source node let in): CRIU's
pages, and then the few MB CRIU wrote besides them (with the root file system's changes). The target
agent unpacks those beside the pages and writes ``podmigrate-verified.json``: the waiting ``create``
restores. Routes (mutual TLS, the operator only)::

    POST /v1/streams                  target: {checkpoint_id, containers} -> the directories to restore from
    POST /v1/streams/listen           target: {checkpoint_id, container, seal, peer} -> relay ports, once the
                                      copy's container waits with its page server
    POST /v1/streams/checkpoint       source: {checkpoint_id, container, container_id, target, seal,
                                      leave_running} -> runc's checkpoint, pages and the rest sent
    POST /v1/streams/verify           target: {checkpoint_id, container} -> verified (the copy restores)
    POST /v1/streams/abort            target: {checkpoint_id} -> every waiting copy of it fails at once
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from podmigrate.agent.http import App
from podmigrate.agent.memory import Reservations
from podmigrate.errors import RuntimeBackendError, TransportError, UsageError
from podmigrate.k8s.restores import VERIFIED, Restores, _unpack
from podmigrate.k8s.rootfs import rootfs_diff
from podmigrate.k8s.streams_lazy import Lazy
from podmigrate.transport.pagerelay import SourceRelay, TargetRelay

_ID = re.compile(r"^[0-9a-f]{64}$")  # a containerd or CRI-O container id
LISTEN_S = 100.0  # how long the copy's container may take to reach its create (pull, sandbox)
RELAY_S = 600.0
VERIFY_S = 60.0  # the source has finished when verify is asked: what has not arrived by then never will


def _checked(cid: str) -> str:
    if not _ID.fullmatch(cid):
        raise UsageError(f"not a container id: {cid!r}")
    return cid


def container_pids(cid: str, proc: Path = Path("/proc")) -> tuple[int, int]:
    """(the container's first process, its parent: the runtime's shim) found by the cgroup every
    runtime names after the container id; never by a process name (other nodes share the host here)."""
    _checked(cid)
    inside: dict[int, int] = {}
    for p in proc.iterdir():
        if not p.name.isdigit():
            continue
        try:
            if cid not in (p / "cgroup").read_text():
                continue
            ppid = int(next(ln for ln in (p / "status").read_text().splitlines() if ln.startswith("PPid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile
        inside[int(p.name)] = ppid
    first = [pid for pid, ppid in inside.items() if ppid not in inside]
    if len(first) != 1:
        raise RuntimeBackendError(
            f"container {cid[:12]} has {len(first) or 'no'} first processes in its cgroup",
            hint="the agent needs hostPID: true (deploy/kubernetes/stream) to see the node's processes",
        )
    return first[0], inside[first[0]]


def rss(cid: str, proc: Path = Path("/proc")) -> int:
    """The resident memory of the container's processes (found by its cgroup), in bytes."""
    total = 0
    for p in proc.iterdir():
        try:
            if p.name.isdigit() and cid in (p / "cgroup").read_text():
                line = next(ln for ln in (p / "status").read_text().splitlines() if ln.startswith("VmRSS:"))
                total += int(line.split()[1]) * 1024
        except (OSError, StopIteration, ValueError):
            continue
    return total


def _pack(out: BinaryIO, images: Path, diff: Path | None) -> None:
    """CRIU's images (and the root file system's changes) as a tar stream: a checkpoint sent without a
    page server carries its pages in it, so it is never held in memory whole."""
    with tarfile.open(fileobj=out, mode="w|") as t:
        t.add(images, arcname="checkpoint")
        if diff is not None and diff.exists():
            t.add(diff, arcname="rootfs-diff.tar")


def _sink(listener: socket.socket, dest: Path, done: threading.Event, box: dict[str, Any]) -> None:
    """Accept the target relay's one connection and write what it brings into ``dest``."""
    try:
        listener.settimeout(RELAY_S)
        conn, _ = listener.accept()
        with conn, open(dest, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as out:
            while chunk := conn.recv(1 << 20):
                out.write(chunk)
                box["bytes"] = box.get("bytes", 0) + len(chunk)
    except OSError as e:
        box["error"] = str(e)
    finally:
        listener.close()
        done.set()


@dataclass
class Waiting:
    """One container of a migration on the target: its relays and where the rest lands."""

    pages: TargetRelay | None  # None: the whole checkpoint comes as the rest (no page server)
    images: TargetRelay
    received: threading.Event
    box: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        for relay in (self.pages, self.images):
            if relay is not None:
                relay.close()


@dataclass
class Streams:
    restores: Restores
    address: str  # this node's address the source's relays connect to
    memory: Reservations = field(default_factory=Reservations)  # backed before the pages arrive
    runc: str = "runc"
    runc_root: str = "/run/containerd/runc/k8s.io"
    checkpoint: bool = False  # the source side: runc checkpoint (needs hostPID and privileges)
    _waiting: dict[tuple[str, str], Waiting] = field(default_factory=dict)
    lazy: Lazy = field(init=False)  # post-copy (k8s.streams_lazy), on the same directories and relays

    def __post_init__(self) -> None:
        self.lazy = Lazy(self)

    def routes(self, app: App) -> None:
        app.route("POST", "/v1/streams")(lambda p, b: self.prepare(str(b["checkpoint_id"]), list(b["containers"])))
        app.route("POST", "/v1/streams/listen")(lambda p, b: self.listen(b))
        app.route("POST", "/v1/streams/verify")(
            lambda p, b: self.verify(str(b["checkpoint_id"]), str(b["container"]), b)
        )
        app.route("POST", "/v1/streams/abort")(lambda p, b: self.abort(str(b["checkpoint_id"])))
        self.memory.register(app)
        self.lazy.routes(app)
        if self.checkpoint:
            app.route("POST", "/v1/streams/checkpoint")(lambda p, b: self.dump(b))
            # undo a pause: the source serves on (a rollback)
            app.route("POST", "/v1/streams/thaw")(lambda p, b: self._each(b["container_ids"], "resume"))
            # a source frozen since its dump, once its pod is being deleted: SIGTERM waits for a thaw
            # that never comes (the grace period, 30 s, with its memory held); SIGKILL ends it at once
            app.route("POST", "/v1/streams/kill")(lambda p, b: self._each(b["container_ids"], "kill", "KILL"))
            app.route("POST", "/v1/streams/rss")(
                lambda p, b: {"bytes": sum(rss(_checked(i)) for i in b["container_ids"])}
            )

    # ------------------------------------------------------------------ target

    def prepare(self, cid: str, containers: list[str]) -> dict[str, Any]:
        out = {}
        for c in containers:
            local, node = self.restores._dir(cid, c)
            shutil.rmtree(local, ignore_errors=True)
            (local / "checkpoint").mkdir(mode=0o700, parents=True)
            out[c] = str(node)
        return {"restores": out}

    def listen(self, b: dict[str, Any]) -> dict[str, Any]:
        cid, c = str(b["checkpoint_id"]), str(b["container"])
        local, _ = self.restores._dir(cid, c)
        ready = local / "page-server.json"
        until = time.monotonic() + float(b.get("timeout", LISTEN_S))
        while b.get("wait", b.get("pages", True)) and not ready.exists():
            if (local / "abort").exists() or not local.exists():
                raise UsageError(f"checkpoint {cid} of {c} was aborted before its copy waited")
            if time.monotonic() > until:
                raise RuntimeBackendError(
                    f"the copy's container {c} did not start waiting for its checkpoint here in "
                    f"{b.get('timeout', LISTEN_S)} s",
                    hint="its pod's events say why (image pull, sandbox); the podmigrate RuntimeClass must be "
                    "this node's handler",
                )
            time.sleep(0.01)
        key, peer = str(b["seal"]), b.get("peer")
        self.memory.release(cid)  # backed memory for the pages' page cache, then the restored heap
        box: dict[str, Any] = {}
        received = threading.Event()
        sink = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_sink, args=(sink, local / "rest.tar", received, box), daemon=True).start()
        pages = None
        said = json.loads(ready.read_text()) if ready.exists() else {}
        if b.get("pages", True):
            pages = TargetRelay(f"{cid}.{c}", key, self.address, int(said["port"]), RELAY_S, peer)
        w = Waiting(
            pages,
            TargetRelay(f"{cid}.{c}.rest", key, self.address, sink.getsockname()[1], RELAY_S, peer),
            received,
            box,
        )
        self._waiting[(cid, c)] = w
        return {"pages_port": pages.port if pages else None, "rest_port": w.images.port, "address": self.address,
                "pod_ip": said.get("pod_ip")}  # fmt: skip

    def verify(self, cid: str, c: str, b: dict[str, Any] | None = None) -> dict[str, Any]:
        """The rest is in: the waiting create may restore. ``b["lazy"]``: ``{address, port}`` of the
        source's relay, for a post-copy restore's daemon (``k8s.streams_lazy``)."""
        w = self._waiting.pop((cid, c), None)
        if w is None:
            raise UsageError(f"no streamed checkpoint {cid} of {c} is waiting on this node")
        local, node = self.restores._dir(cid, c)
        try:
            for what, relay in (("pages", w.pages), ("rest of the checkpoint", w.images)):
                if relay is not None and (not relay.wait(VERIFY_S) or relay.error):
                    raise TransportError(f"the {what} of {c} did not all arrive: {relay.error or 'timed out'}")
            if not w.received.wait(VERIFY_S) or "error" in w.box:
                raise TransportError(f"the rest of {c}'s checkpoint was not written: {w.box.get('error')}")
            _unpack(local / "rest.tar", local)
        except TransportError:
            (local / "abort").touch()  # the waiting create fails now rather than at its deadline
            w.close()
            raise
        finally:
            (local / "rest.tar").unlink(missing_ok=True)
        if b and b.get("lazy"):
            self.lazy.give(local, cid, c, str(b["seal"]), (str(b["lazy"]["address"]), int(b["lazy"]["port"])))
        elif w.pages is not None:  # the copy runs on a local daemon copying these pages in
            self.lazy.watch(local)
        info = {
            "stream": True,
            "pages_bytes": w.pages.bytes if w.pages else {},
            "rest_bytes": w.box.get("bytes", 0),
            "at": time.time(),
        }
        tmp = local / f"{VERIFIED}.tmp"
        tmp.write_text(json.dumps(info))
        tmp.chmod(0o600)
        tmp.rename(local / VERIFIED)  # the waiting create restores from here on
        return {"path": str(node), **info}

    def abort(self, cid: str) -> dict[str, Any]:
        aborted = []
        for (c_id, c), w in list(self._waiting.items()):
            if c_id == cid:
                w.close()
                del self._waiting[(c_id, c)]
        local, _ = self.restores._dir(cid)
        for d in local.iterdir() if local.exists() else []:
            (d / "abort").touch()
            aborted.append(d.name)
        return {"aborted": sorted(aborted)}

    # ------------------------------------------------------------------ source

    def dump(self, b: dict[str, Any]) -> dict[str, Any]:
        cid, c, ctr = str(b["checkpoint_id"]), str(b["container"]), str(b["container_id"])
        host, key = str(b["target"]), str(b["seal"])
        local, there = self.out_dir(cid, c)
        try:
            return self._dump(cid, c, ctr, host, key, b, local, there)
        finally:
            self.drop_out_dir(local)  # pages never land here; the rest went to the target

    def out_dir(self, cid: str, c: str) -> tuple[Path, Path]:
        """A dump's directory on the source, made empty: (as the agent sees it, as the node sees it)."""
        local, there = self.restores._dir(f"out-{cid}", c)
        shutil.rmtree(local, ignore_errors=True)
        local.parent.mkdir(mode=0o700, exist_ok=True)
        for d in ("checkpoint", "work"):
            (local / d).mkdir(mode=0o700, parents=True)
        return local, there

    @staticmethod
    def drop_out_dir(local: Path) -> None:
        shutil.rmtree(local, ignore_errors=True)
        with contextlib.suppress(OSError):  # the last of the migration's containers takes the directory
            local.parent.rmdir()

    @staticmethod
    def node(ctr: str) -> list[str]:
        """The prefix that runs a command in the node's mount namespace, entered through the shim of
        container ``ctr`` (found by its cgroup)."""
        _pid, shim = container_pids(ctr)
        return ["nsenter", "-t", str(shim), "-m", "--"]

    def _dump(
        self, cid: str, c: str, ctr: str, host: str, key: str, b: dict[str, Any], local: Path, there: Path
    ) -> dict[str, Any]:
        work = local / "work"
        node = self.node(ctr)
        pages = SourceRelay(f"{cid}.{c}", key, (host, int(b["pages_port"]))) if b.get("pages_port") else None
        argv = [*node, self.runc, "--root", self.runc_root, "checkpoint", "--image-path", str(there / "checkpoint"),
                "--work-path", str(there / "work")]  # fmt: skip
        if pages is not None:  # else the pages are written here and go with the rest
            argv += ["--page-server", f"127.0.0.1:{pages.port}"]
        if b.get("leave_running", True):
            argv.append("--leave-running")
        t0 = time.time()
        if b.get("pause"):  # stop-copy: after its dump the source stays frozen (CRIU restores the freezer's
            # state): a request it took before its isolation is never answered from memory the copy lacks
            self._runc(node, "pause", ctr)
        with ThreadPoolExecutor(1) as pool:
            # a paused container writes nothing more: its root file system's changes are taken meanwhile
            diff = pool.submit(rootfs_diff, node, ctr, local, there) if b.get("pause") else None
            p = subprocess.run([*argv, ctr], capture_output=True, text=True, timeout=float(b.get("timeout", 600)))
            dumped = time.time()
            if p.returncode != 0:
                if pages is not None:
                    pages.close()
                raise RuntimeBackendError(
                    f"runc checkpoint of {c} failed (exit {p.returncode}): "
                    f"{_criu_error(work) or p.stderr.strip()[-300:]}",
                    hint="CRIU's dump.log is in the work directory while the agent runs",
                )
            if pages is not None and (not pages.wait(60) or pages.error):
                raise TransportError(f"the pages of {c} did not all reach the target: {pages.error or 'timed out'}")
            rest = diff.result() if diff else rootfs_diff(node, ctr, local, there)
        sent = self.send_rest(cid, c, key, (host, int(b["rest_port"])), local, rest)
        moved = pages.bytes["pages"] if pages else 0
        return {"seconds": dumped - t0, "total_seconds": time.time() - t0, "pages_bytes": moved, "rest_bytes": sent}

    def send_rest(self, cid: str, c: str, key: str, target: tuple[str, int], local: Path, diff: Path | None) -> int:
        """What CRIU wrote in the dump directory, with the container's writes to its root file system
        (``k8s.rootfs``), to the target's rest channel; bytes sent."""
        return self._send(cid, c, key, *target, lambda f: _pack(f, local / "checkpoint", diff))

    def _runc(self, node: list[str], *args: str, check: bool = True) -> bool:
        p = subprocess.run([*node, self.runc, "--root", self.runc_root, *args], capture_output=True, text=True)
        if check and p.returncode != 0:
            raise RuntimeBackendError(f"runc {args[0]} of {args[1][:12]} failed: {p.stderr.strip()[-300:]}")
        return p.returncode == 0

    def _each(self, ids: list[str], verb: str, *extra: str) -> dict[str, Any]:
        """``runc VERB ID EXTRA`` for each container still there (a container not paused stays so)."""
        out = {}
        for ctr in ids:
            try:
                node = self.node(_checked(str(ctr)))
            except RuntimeBackendError:
                out[ctr] = False  # gone already
                continue
            out[ctr] = self._runc(node, verb, ctr, *extra, check=False)
        return {"done": out}

    @staticmethod
    def _send(cid: str, c: str, key: str, host: str, port: int, write: Callable[[BinaryIO], object]) -> int:
        relay = SourceRelay(f"{cid}.{c}.rest", key, (host, port))
        with socket.create_connection(("127.0.0.1", relay.port), timeout=30) as s:
            with s.makefile("wb") as f:
                write(f)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        if not relay.wait(60) or relay.error:
            raise TransportError(f"the rest of {c}'s checkpoint did not reach the target: {relay.error}")
        return relay.bytes["pages"]  # what went to the target (the relay's forward direction)


def _criu_error(work: Path) -> str:
    try:
        lines = (work / "dump.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln.strip() for ln in lines if "Error (" in ln]
    return errors[0] if errors else ""
