"""The node agent's CRIU processes that outlive their request: page server (and its sealed relay) and post-copy.

Routes page-server, checkpoint-lazy, restore-lazy, lazy and abort-lazy, registered by ``agent.node``
(which stops what is left here when a checkpoint is deleted); files and locks from
``agent.checkpoints``, memory from ``agent.memory``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate import names, procs
from podmigrate.agent import node_prefetch
from podmigrate.agent.checkpoints import CheckpointDir
from podmigrate.agent.collapses import Collapses
from podmigrate.agent.http import App
from podmigrate.agent.memory import Reservations
from podmigrate.agent.node_prefetch import Prefetches
from podmigrate.agent.node_speculative import Speculations
from podmigrate.agent.peers import Peers
from podmigrate.runtime import criu_conf
from podmigrate.runtime.uffd import FaultWaker
from podmigrate.transport import pagerelay, seal
from podmigrate.transport.stream import Seal

if TYPE_CHECKING:
    from podmigrate.agent.node import NodeRuntime
    from podmigrate.runtime.speculative import Gate


class LazyPages:
    """CRIU processes by role and checkpoint id: the page server receiving a dump (``ps``), the
    source's lazy dump serving pages (``src``), the target's lazy-pages daemon (``dst``)."""

    def __init__(
        self,
        peers: Peers,
        rt: NodeRuntime,
        files: CheckpointDir,
        memory: Reservations,
        criu_tls: Callable[..., tuple[str, ...]] = lambda b, server: (),
        prefetches: Prefetches | None = None,
        speculations: Speculations | None = None,
    ):
        """``criu_tls(request, server=...)``: CRIU's TLS options for a listening or a connecting end,
        as the request asks (``agent.tls.criu_tls_wanted``);
        ``prefetches``: the node's prefetch sender and receiver (``agent.node_prefetch``)."""
        self.peers, self.name = peers, peers.own
        self.rt, self.files, self.memory, self.criu_tls = rt, files, memory, criu_tls
        # the restores podman and runc started before the freeze (its routes are registered here too)
        self.prefetches, self.speculations = prefetches, speculations or Speculations(rt, files)
        self.jobs: dict[str, subprocess.Popen[Any]] = {}
        self.lazy_ports: dict[str, tuple[str, int]] = {}  # where each lazy dump's CRIU serves pages
        self.wakers: dict[str, FaultWaker] = {}
        self.relays: dict[str, pagerelay.TargetRelay] = {}
        # a lazy migration's sealed relay, by role as the jobs: the source's listener, the target's dialer
        self.lazy_relays: dict[str, pagerelay.Relay] = {}
        self.collapses = Collapses(lambda name: rt.huge_pages(name))

    def register(self, app: App) -> None:
        app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/page-server")(self.page_server)
        app.route("POST", "/v1/containers/(?P<name>[^/]+)/checkpoint-lazy")(self.checkpoint_lazy)
        app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/restore-lazy")(self.restore_lazy)
        app.route("GET", "/v1/checkpoints/(?P<cid>[^/]+)/lazy")(self.lazy_status)
        app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/abort-lazy")(self.abort_lazy)
        app.route("POST", "/v1/containers/(?P<name>[^/]+)/huge-pages")(self.huge_pages)
        app.route("GET", "/v1/containers/(?P<name>[^/]+)/huge-pages")(self.huge_pages_status)
        self.speculations.register(app)

    def stop(self, cid: str) -> None:
        """What a deleted checkpoint leaves running here; the source's lazy dump is never killed:
        abort-lazy ends it safely."""
        if self.prefetches is not None:
            self.prefetches.stop(cid)
        self.speculations.stop(cid)
        for role in ("ps", "dst"):
            job = self.jobs.pop(f"{role}-{cid}", None)
            if job is not None and job.poll() is None:
                job.kill()
                job.wait()
        # a daemon or page server an earlier agent started (this one was restarted) would read the
        # images being deleted under it: found by the checkpoint id its command line names
        for proc in _processes(
            cid, lambda argv: argv[0].endswith(b"criu") and argv[1:2] in ([b"lazy-pages"], [b"page-server"])
        ):
            procs.kill(proc, signal.SIGKILL)
        waker = self.wakers.pop(cid, None)
        if waker is not None:
            waker.stop()
        for relay in (self.relays.pop(cid, None), self.lazy_relays.pop(f"dst-{cid}", None)):
            if relay is not None:
                relay.close()
        # the source's dump job stays (abort-lazy ends it); finished ones and their ports are forgotten,
        # so a long run does not grow these tables
        src = self.jobs.get(f"src-{cid}")
        if src is None or src.poll() is not None:
            self.jobs.pop(f"src-{cid}", None)
            self.lazy_ports.pop(cid, None)
            if (relay := self.lazy_relays.pop(f"src-{cid}", None)) is not None:
                relay.close()

    def _free_port(self, address: str | None = None) -> int:
        with socket.socket() as sk:
            sk.bind((address or self.peers.mine(), 0))
            return int(sk.getsockname()[1])

    def page_server(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """Start a CRIU page server that receives the memory pages of checkpoint ``cid``. With
        ``relay`` and the migration's key, CRIU listens on loopback only and the pages arrive at a
        sealed relay (``transport.pagerelay``); else CRIU listens on the LAN, in its own TLS unless the
        request says ``"criu_tls": false``."""
        cid = p["cid"]
        self.memory.release(cid)
        address = self.peers.mine()
        if b.get("relay"):
            key = seal.check_key(b.get("seal"))
            port = self._free_port("127.0.0.1")
            self.jobs[f"ps-{cid}"] = self.rt.page_server(self.files.pages(cid), "127.0.0.1", port)
            peer = names.ipv4(b["peer"]) if b.get("peer") else None  # the source: nobody else gets in
            relay = self.relays[cid] = pagerelay.TargetRelay(cid, key, address, port, peer=peer)
            return {"address": address, "port": relay.port, "relay": True, "criu_tls": False}
        port, tls = self._free_port(), self.criu_tls(b, server=True)  # the page server takes the port right after
        self.jobs[f"ps-{cid}"] = self.rt.page_server(self.files.pages(cid), address, port, tls=tls)
        return {"address": address, "port": port, "relay": False, "criu_tls": bool(tls)}

    def dump_to_page_server(self, cid: str, b: dict[str, Any]) -> tuple[tuple[str, ...], pagerelay.SourceRelay | None]:
        """CRIU's options for a dump whose pages go to the page server in ``b["page_server"]`` (a
        source relay started for it when the target has one), or none."""
        ps = b.get("page_server")
        if not ps:
            return (), None
        # both go into CRIU's configuration file: parsed, so that no value can add an option
        address, port = names.ipv4(ps.get("address")), names.port(ps.get("port"))
        relay = None
        if ps.get("relay"):
            relay = pagerelay.SourceRelay(cid, seal.check_key(b.get("seal")), (address, port), source=self.peers.mine())
            criu: tuple[str, ...] = ("page-server", "address=127.0.0.1", f"port={relay.port}")
        else:
            criu = ("page-server", f"address={address}", f"port={port}", *self.criu_tls(b, server=False))
        if b.get("leave_stopped"):
            criu += ("leave-stopped",)
        return criu, relay

    def checkpoint_lazy(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """A lazy dump that serves its pages until the target has them all. With ``relay`` and the
        migration's key, CRIU serves them in the clear on this node's loopback, and a sealed relay
        (``transport.pagerelay``) lets in only the target (``peer``); else CRIU listens on the LAN,
        in its own TLS unless the request says ``"criu_tls": false``."""
        cid = b["checkpoint_id"]
        key = seal.check_key(b.get("seal")) if b.get("relay") else None
        listen = "127.0.0.1" if key else self.peers.mine()
        port = self._free_port(listen)
        self.collapses.wait(p["name"])  # no dump of memory the kernel is moving
        t0 = time.time()
        with self.files.busy(cid):
            self.jobs[f"src-{cid}"], times = self.rt.lazy_checkpoint(
                p["name"],
                self.files.archive(cid),
                listen,
                port,
                tcp_established=b.get("tcp_established", True),
                tls=() if key else self.criu_tls(b, server=True),
                criu=network_lock(b) + lazy_dump_mode(b),
            )
        self.lazy_ports[cid] = (listen, port)
        served = port
        if key:
            peer = names.ipv4(b["peer"]) if b.get("peer") else None
            relay = self.lazy_relays[f"src-{cid}"] = pagerelay.TargetRelay(cid, key, self.peers.mine(), port, peer=peer)
            served = relay.port
        images, pid = times.pop("images", None), times.pop("pid", None)
        pre = b.get("prefetch") or {}
        prefetching = False
        if self.prefetches is not None and pre.get("mb") and pre.get("seal") and images and pid:
            budget = max(0, min(int(pre["mb"]), 1024)) << 20
            sealed = Seal(seal.check_key(pre["seal"]), cid, bool(pre.get("digest")))
            self.prefetches.start(cid, Path(images), int(pid), budget, self.peers.address(pre["node"]), sealed)
            prefetching = True
        return {
            "address": self.peers.mine(),
            "port": served,
            "relay": bool(key),
            "criu_port": port,  # for abort-lazy after an agent restart: the dump's own, on ``listen``
            "started": t0,
            "times": times,
            "ended": time.time(),
            "archive_bytes": self.files.archive(cid).stat().st_size,
            "stats": {},
            "prefetch": prefetching,
            "dump_mode": "read" if lazy_dump_mode(b) else "splice",
        }

    def restore_lazy(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        cid = p["cid"]
        if b.get("image"):
            self.rt.ensure_image(b["image"])
        # how long the restore may wait for a prefetch the source is sending (agent.node_prefetch)
        wait = max(0.0, min(float(b.get("prefetch_wait_s") or 0), 10.0))
        # podman's part of the restore, done before the freeze and waiting (agent.node_speculative)
        gate = self.speculations.take(cid) if b.get("speculative") else None
        action = (
            node_prefetch.script(self.files.pages(cid), wait, defer=b.get("prefetch_defer", True)) if wait else None
        )
        source: tuple[str, int] = (names.ipv4(b.get("address")), names.port(b.get("port")))
        tls = () if b.get("relay") else self.criu_tls(b, server=False)
        if b.get("relay"):  # the daemon fetches from this node's loopback; the relay seals the way there
            key = seal.check_key(b.get("seal"))
            relay = pagerelay.SourceRelay(cid, key, source, source=self.peers.mine())
            self.lazy_relays[f"dst-{cid}"] = relay
            source = ("127.0.0.1", relay.port)
        try:
            res, waker, speculative = self._restore(cid, b, gate, *source, tls=tls, action_script=action)
        except BaseException:
            if (relay_left := self.lazy_relays.pop(f"dst-{cid}", None)) is not None:
                relay_left.close()
            raise
        used = node_prefetch.outcome(self.files.pages(cid)) if wait else None
        return {
            **res,
            "wake_faults": waker is not None,
            "prefetch": used,
            "speculative": speculative,
            "criu_tls": bool(tls),
            "relay": bool(b.get("relay")),
        }

    def restore_from_pages(self, cid: str, b: dict[str, Any]) -> Any:
        """A streamed dump's restore that leaves its memory in the images the page server wrote: a
        local lazy-pages daemon copies it in while the copy already runs, so the blackout does not
        include reading the whole heap (``lazy`` reports the daemon until every page is in); a
        stop-copy's podman part of it may be waiting at its gate since before the freeze."""
        gate = self.speculations.take(cid) if b.get("speculative") else None
        res, _, speculative = self._restore(cid, b, gate, None, None)
        return {**res, "image_pulled": b.get("image_pulled", False), "lazy_local": True, "speculative": speculative}

    def _restore(
        self, cid: str, b: dict[str, Any], gate: Gate | None, *source: Any, **opts: Any
    ) -> tuple[dict[str, Any], FaultWaker | None, str | None]:
        """The runtime's lazy restore of checkpoint ``cid`` (``source``: the dump's address and port,
        or None, None for pages already here); its daemon kept as the checkpoint's ``dst``. Whatever
        fails before the gate opened (a bad archive, say) cancels the waiting restore now, not when
        the gate's own timeout ends it, which would hold the container's lock."""
        try:
            with self.files.busy(cid):
                res, daemon, waker = self.rt.lazy_restore(
                    self.files.archive(cid),
                    self.files.pages(cid),
                    self.files.work(cid),
                    *source,
                    tcp_established=b.get("tcp_established", True),
                    wake_faults=b.get("wake_faults", True),
                    gate=gate,
                    network=str(b.get("copy_network", "keep")),
                    **opts,
                )
        except BaseException:
            if gate is not None and not gate.released:
                gate.cancel()
            raise
        self.jobs[f"dst-{cid}"] = daemon
        if waker:
            self.wakers[cid] = waker
        speculative = ("used" if gate else "gone: restored after the dump") if b.get("speculative") else None
        return res, waker, speculative

    def lazy_status(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        for role in ("src", "dst"):
            job = self.jobs.get(f"{role}-{p['cid']}")
            if job is not None:
                out[role] = {"running": job.poll() is None, "rc": job.returncode}
        if p["cid"] in self.wakers:
            out["waker"] = self.wakers[p["cid"]].status()
        for role in ("src", "dst"):
            relay = self.lazy_relays.get(f"{role}-{p['cid']}")
            if relay is not None:  # bytes each way (the pages one way, the daemon's requests the other)
                out.setdefault(role, {})["relay"] = {"bytes": relay.bytes, "error": relay.error}
        pre = self.prefetches.status(p["cid"]) if self.prefetches else None
        if pre is not None:
            out["prefetch"] = pre
        # bytes this node sent on its LAN link: across a post-copy, the pages its dump served
        # (/proc/net/dev, not /sys/class/net: sysfs shows the netns of whoever mounted it)
        with contextlib.suppress(OSError, ValueError, IndexError):
            line = next(
                ln for ln in Path("/proc/self/net/dev").read_text().splitlines() if ln.strip().startswith("eth0:")
            )
            out["lan_tx_bytes"] = int(line.split(":", 1)[1].split()[8])
        return out

    def huge_pages(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """After a lazy restore's last page: the copy's memory back in huge pages (``runtime.hugepages``),
        in the background with ``"background": true`` (``agent.collapses``), else the outcome."""
        started = self.collapses.start(p["name"])
        return started if b.get("background") else self.collapses.wait(p["name"])

    def huge_pages_status(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.collapses.status(p["name"])

    def abort_lazy(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """Make a lazy dump that no target is pulling from give up: CRIU's page server gets a request
        it does not know, fails, and then thaws the tasks and unlocks the network (its error path).

        A dump that an earlier agent started (this one was restarted: its job table is new) is found
        by its checkpoint id among the node's processes, and given up the same way at the port the
        caller recorded; without that, it would hold the container's lock, and every podman command
        behind it, for as long as it waits for a target."""
        cid = p["cid"]
        job = self.jobs.get(f"src-{cid}")
        if job is not None and job.poll() is not None:
            return {"aborted": False, "rc": job.returncode}
        # the dump's own listener: a relayed one's CRIU is on loopback (its relay lets in the target only)
        relayed = b.get("relay") and b.get("criu_port")
        at = self.lazy_ports.get(cid) or (
            ("127.0.0.1", int(b["criu_port"])) if relayed else (self.peers.mine(), int(b.get("port") or 0))
        )
        if job is None and not orphaned_dump(cid):
            return {"aborted": False, "rc": None}
        if at[1]:
            with contextlib.suppress(OSError), socket.create_connection(at, 5) as sk:
                sk.sendall(b"\xff" * 64)
        if (relay := self.lazy_relays.pop(f"src-{cid}", None)) is not None:
            relay.close()
        if job is not None:
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
            return {"aborted": True, "rc": job.returncode}
        deadline = time.monotonic() + 60
        while orphaned_dump(cid) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in orphaned_dump(cid):  # still there: killed, the group too where it leads one (its podman's)
            kill_orphan(proc)
        return {"aborted": True, "rc": None, "orphan": True}


def network_lock(b: dict[str, Any]) -> tuple[str, ...]:
    """CRIU's option for a dump whose controller asked for the old network lock (engine.paths
    "iptables-network-lock"); the node's configuration says nftables."""
    return ("network-lock=iptables",) if b.get("network_lock") == "iptables" else ()


def lazy_dump_mode(b: dict[str, Any]) -> tuple[str, ...]:
    """CRIU's option that leaves a lazy dump's pages in the frozen tasks, where this node's CRIU has
    it (``lab.criu_build``) and the controller did not ask for CRIU's own way (engine.paths
    "lazy-dump-splice")."""
    if b.get("lazy_dump") == "splice" or not criu_conf.has_option("--lazy-dump-mode"):
        return ()
    return ("lazy-dump-mode=read",)


def orphaned_dump(cid: str) -> list[procs.Proc]:
    """The podman/runc/CRIU processes of lazy dump ``cid`` (their command lines name its archive)."""
    return _processes(cid, lambda argv: any(a.endswith((b"podman", b"criu", b"runc")) for a in argv[:1]))


def _processes(cid: str, which: Callable[[list[bytes]], bool]) -> list[procs.Proc]:
    """This node's processes whose command line names checkpoint ``cid`` and that ``which`` picks.

    Only this node's own: the lab's nodes share one pid namespace, and the peer of a migration runs
    processes naming the same checkpoint id; a node's podman, runc and CRIU share its agent's mount
    namespace, a peer's do not."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not procs.same_mount_ns(int(entry)):
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(cid.encode() in a for a in argv) and which(argv) and (p := procs.identify(int(entry))):
            found.append(p)
    return found


def kill_orphan(p: procs.Proc) -> None:
    """SIGKILL an orphaned dump's process; its whole group where it leads one (the dump's podman was
    started in a session of its own, with runc and CRIU below it), never this agent's group."""
    with contextlib.suppress(ProcessLookupError, OSError):
        if os.getpgid(p.pid) == p.pid != os.getpgrp() and procs.alive(p):
            os.killpg(p.pid, signal.SIGKILL)
    procs.kill(p, signal.SIGKILL)
