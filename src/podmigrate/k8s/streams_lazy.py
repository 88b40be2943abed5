"""Post-copy on Kubernetes (``mode: lazy``): the node agents' side, beside ``k8s.streams``.

The source's agent starts ``runc checkpoint --lazy-pages``: CRIU dumps all but the memory, then serves
the pages from the frozen source on a loopback port; the agent's relay (``transport.pagerelay``,
sealed, only the target node let in) carries them between the nodes, and the rest of the checkpoint
goes to the target as for a streamed one. The target's agent gives the waiting ``create`` the port of
its end of the relay (``lazy.json``): it starts ``criu lazy-pages`` and restores with
``--lazy-pages``; the copy runs before its memory has moved, faulting pages over, the rest following
in the background. The agent wakes the faults CRIU's daemon drops (``runtime.uffd``). Once every page
has moved the source's CRIU ends; the source's container stays, frozen, until the migration's cleanup
kills it through runc (``--leave-running``: a runc checkpoint that ends the container itself removes
it from under its shim, whose connection then closes, and the kubelet retries the pod's deletion for
its whole grace period, holding up that node's other pods). Routes::

    POST /v1/streams/lazy             source: {checkpoint_id, container, container_id, target, rest_port,
                                      seal, prefetch_mb?} -> the relay port the target's daemon reaches,
                                      once serving, and what of the small mappings went with the rest
    POST /v1/streams/lazy/wait        source: {checkpoint_id, container} -> every page moved, seconds, bytes
    POST /v1/streams/lazy/abort       source: {checkpoint_id} -> the dump killed, the source thawed
    POST /v1/streams/pages            target: {checkpoint_id, container} -> a streamed copy's local daemon
                                      has copied its last page in (``runtime.runc_restore``), seconds
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate.errors import RuntimeBackendError, TransportError, UsageError
from podmigrate.k8s.rootfs import rootfs_diff
from podmigrate.runtime import prefetch
from podmigrate.runtime.uffd import FaultWaker
from podmigrate.transport.pagerelay import SourceRelay, TargetRelay

if TYPE_CHECKING:
    from podmigrate.k8s.streams import Streams

SERVING_S = 120.0  # until CRIU has dumped all but the memory and serves it


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    relay: TargetRelay
    local: Path
    node: list[str]
    ctr: str
    started: float
    serving: float


class _Pid:
    """A process the agent did not start (the lazy-pages daemon, a child of the node's runtime), as
    much of ``Popen`` as ``FaultWaker`` asks: whether it still runs."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return 0 if f.read().rsplit(")", 1)[1].split()[0] == "Z" else None
        except OSError:
            return 0


@dataclass
class Lazy:
    streams: Streams
    _running: dict[tuple[str, str], Running] = field(default_factory=dict)
    _wakers: list[FaultWaker] = field(default_factory=list)

    def routes(self, app: Any) -> None:
        if self.streams.checkpoint:
            app.route("POST", "/v1/streams/lazy")(lambda p, b: self.dump(b))
            app.route("POST", "/v1/streams/lazy/wait")(lambda p, b: self.wait(b))
            app.route("POST", "/v1/streams/lazy/abort")(lambda p, b: self.abort(str(b["checkpoint_id"])))
        app.route("POST", "/v1/streams/pages")(lambda p, b: self.pages_in(b))

    # ------------------------------------------------------------------ source

    def dump(self, b: dict[str, Any]) -> dict[str, Any]:
        s = self.streams
        cid, c, ctr = str(b["checkpoint_id"]), str(b["container"]), str(b["container_id"])
        host, key = str(b["target"]), str(b["seal"])
        local, there = s.out_dir(cid, c)
        node = s.node(ctr)
        port = _free_port()
        r, w = os.pipe()
        argv = [*node, s.runc, "--root", s.runc_root, "checkpoint", "--image-path", str(there / "checkpoint"),
                "--work-path", str(there / "work"), "--lazy-pages", "--page-server", f"127.0.0.1:{port}",
                "--leave-running", "--status-fd", str(w), ctr]  # fmt: skip
        env = _criu_env(node, local, there, b)
        t0 = time.time()
        if b.get("pause"):  # frozen from here on: what it answers after its isolation is never lost
            s._runc(node, "pause", ctr)
        paused = time.time()
        with ThreadPoolExecutor(1) as pool:
            # a paused container writes nothing more: its root file system's changes are taken meanwhile
            diff = pool.submit(rootfs_diff, node, ctr, local, there)
            # its own process group: a dump that never serves is killed whole (nsenter, runc, CRIU)
            proc = subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, start_new_session=True, env=env)  # fmt: skip
            os.close(w)
            try:
                ready, _, _ = select.select([r], [], [], SERVING_S)
                if not ready or os.read(r, 1) != b"\0":
                    _kill(proc)
                    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip()[-300:]
                    raise RuntimeBackendError(f"lazy checkpoint of {c} did not start serving its pages: {err}")
            finally:
                os.close(r)
            serving = time.time()
            relay = TargetRelay(f"{cid}.{c}", key, s.address, port, 600.0, host)
            self._running[(cid, c)] = Running(proc, relay, local, node, ctr, t0, serving)
            hot = _prefetch(local / "checkpoint", ctr, int(b.get("prefetch_mb", prefetch.DEFAULT_MB)))
            hot_at = time.time()
            rest = diff.result()
        sent = s.send_rest(cid, c, key, (host, int(b["rest_port"])), local, rest)
        steps = {
            "pause": paused - t0,
            "dump": serving - paused,
            "prefetch": hot_at - serving,
            "rest": time.time() - hot_at,
        }
        return {"seconds": serving - t0, "lazy_port": relay.port, "address": s.address, "pages_bytes": 0,
                "rest_bytes": sent, "prefetch": hot, "steps": {k: round(v, 4) for k, v in steps.items()}}  # fmt: skip

    def wait(self, b: dict[str, Any]) -> dict[str, Any]:
        cid, c = str(b["checkpoint_id"]), str(b["container"])
        run = self._running.get((cid, c))
        if run is None:
            raise UsageError(f"no lazy checkpoint {cid} of {c} is serving on this node")
        try:
            rc = run.proc.wait(float(b.get("timeout", 600)))
        except subprocess.TimeoutExpired:
            raise TransportError(f"the pages of {c} did not all move in {b.get('timeout', 600)} s") from None
        self._running.pop((cid, c), None)
        run.relay.wait(10)
        self.streams.drop_out_dir(run.local)
        if rc != 0:
            raise RuntimeBackendError(f"the lazy checkpoint of {c} ended with exit {rc}: its pages did not all move")
        moved = run.relay.bytes["pages-answers"]
        return {"seconds": time.time() - run.serving, "bytes": moved}

    def abort(self, cid: str) -> dict[str, Any]:
        """Before the copy runs: the dump killed, the source thawed (CRIU may have left it frozen)."""
        aborted = []
        for (c_id, c), run in list(self._running.items()):
            if c_id != cid:
                continue
            _kill(run.proc)
            run.relay.close()
            self.streams._runc(run.node, "resume", run.ctr, check=False)
            self.streams.drop_out_dir(run.local)
            del self._running[(c_id, c)]
            aborted.append(c)
        return {"aborted": aborted}

    # ------------------------------------------------------------------ target

    def give(self, local: Path, cid: str, c: str, key: str, source: tuple[str, int]) -> SourceRelay:
        """The target's end: the waiting create's daemon connects here; once it runs, wake its dropped faults."""
        relay = SourceRelay(f"{cid}.{c}", key, source, accept_seconds=120.0)
        (local / "lazy.json").write_text(json.dumps({"port": relay.port}))
        threading.Thread(target=self._wake, args=(local,), daemon=True).start()
        return relay

    def watch(self, local: Path) -> None:
        """A streamed restore's local daemon (``runtime.runc_restore``): wake its dropped faults once it runs."""
        threading.Thread(target=self._wake, args=(local,), daemon=True).start()

    def pages_in(self, b: dict[str, Any]) -> dict[str, Any]:
        """Wait until the copy's local lazy-pages daemon has copied the last page into it (the images
        may go then); seconds since it started. A restore that read its pages at once had none."""
        cid, c = str(b["checkpoint_id"]), str(b["container"])
        local, _ = self.streams.restores._dir(cid, c)
        pidfile = local / "lazy-daemon.pid"
        if not pidfile.exists():
            return {"lazy": False, "seconds": 0.0}
        started, pid = pidfile.stat().st_mtime, int(pidfile.read_text())
        until = time.monotonic() + float(b.get("timeout", 600))
        while _runs(pid, b"lazy-pages"):
            if time.monotonic() > until:
                raise TransportError(f"the copy's memory ({c}) was not all in after {b.get('timeout', 600)} s")
            time.sleep(0.02)
        try:
            log = (local / "lazy-pages.log").read_text(errors="replace").splitlines()
        except OSError:
            log = []
        errors = [ln for ln in log if "Error (" in ln]
        if errors:
            raise RuntimeBackendError(f"the lazy-pages daemon of {c}'s copy failed: {errors[0].strip()[:300]}")
        return {"lazy": True, "seconds": time.time() - started}

    def _wake(self, local: Path) -> None:
        until = time.monotonic() + 60
        while not (local / "lazy-daemon.pid").exists():
            if time.monotonic() > until or (local / "abort").exists():
                return
            time.sleep(0.01)
        waker = FaultWaker(_Pid(int((local / "lazy-daemon.pid").read_text())))  # type: ignore[arg-type]
        self._wakers = [w for w in self._wakers if w.status()["running"]] + [waker.start()]


def _criu_env(node: list[str], local: Path, there: Path, b: dict[str, Any]) -> dict[str, str] | None:
    """The environment of a lazy dump's runc, whose CRIU inherits it: a configuration file of this
    dump's alone (``CRIU_CONFIG_FILE``, read before the node's runc.conf) asking podmigrate's CRIU to
    leave the pages in the frozen tasks (``lab.criu_build``: nothing pinned into pipes inside the
    freeze, some 40 ms of a 1 GB dump) where the node's CRIU has that option and the request did not
    ask for CRIU's own way (``lazy_dump: splice``)."""
    if b.get("lazy_dump") == "splice" or not _reads_lazily(node):
        return None
    conf = local / "criu.conf"
    conf.write_text("lazy-dump-mode=read\n")
    conf.chmod(0o600)
    return {**os.environ, "CRIU_CONFIG_FILE": str(there / "criu.conf")}


_NODE_CRIU: dict[str, bool] = {}  # what the node's CRIU can do, asked once per agent


def _reads_lazily(node: list[str]) -> bool:
    """Whether the node's CRIU knows ``--lazy-dump-mode`` (its usage names it)."""
    if "lazy-dump-mode" not in _NODE_CRIU:
        try:
            p = subprocess.run([*node, "criu", "--help"], capture_output=True, text=True, timeout=30)
            _NODE_CRIU["lazy-dump-mode"] = "--lazy-dump-mode" in p.stdout + p.stderr
        except (OSError, subprocess.TimeoutExpired):
            return False
    return _NODE_CRIU["lazy-dump-mode"]


def _prefetch(images: Path, ctr: str, mb: int) -> dict[str, Any]:
    """The smallest mappings' lazy pages made present in the dump's images before the rest goes
    (``runtime.prefetch``): the copy's first request touches them (interpreter state, arenas,
    stacks), and each would otherwise be a fault served from here across both relays. The source is
    frozen until its last page has moved, so what is read is what the copy would have fetched. The
    heap stays lazy; a failure leaves the dump fully lazy, said in the result."""
    if mb <= 0:
        return {"bytes": 0}
    from podmigrate.k8s.streams import container_pids  # that module builds on this one

    try:
        return prefetch.pull_hot_pages(images, container_pids(ctr)[0], mb << 20)
    except (OSError, ValueError, RuntimeBackendError) as e:
        return {"bytes": 0, "error": f"{type(e).__name__}: {e}"}


def _runs(pid: int, name: bytes) -> bool:
    """Process ``pid`` runs (not a zombie) and is ``name`` (its pid file may outlive it; pids are reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if name not in f.read():
                return False
    except OSError:
        return False
    return _Pid(pid).poll() is None


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
