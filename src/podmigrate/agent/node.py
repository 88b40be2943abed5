"""The node agent's routes: containers, pods, checkpoints and their transports (standard library only).

Served by ``agent.server`` over ``agent.http``; CRIU's long-running processes are in
``agent.node_lazy``, images in ``agent.node_images``, memory reservations in ``agent.memory``, file names and locks in
``agent.checkpoints``; the checkpoint bytes move through ``transport`` (``registry``, ``stream``,
``archive``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate import layout, names
from podmigrate.agent import node_prefetch, tls
from podmigrate.agent.checkpoints import CheckpointDir
from podmigrate.agent.http import App, safe_id
from podmigrate.agent.memory import Reservations
from podmigrate.agent.node_images import NodeImages
from podmigrate.agent.node_lazy import LazyPages, network_lock
from podmigrate.agent.node_prefetch import Prefetches
from podmigrate.agent.notice import SpotNotice
from podmigrate.agent.peers import Peers
from podmigrate.errors import RuntimeBackendError, TransportError, UsageError
from podmigrate.runtime.lazy import LazyPagesUnavailable
from podmigrate.transport import seal, stream
from podmigrate.transport.archive import ArchiveTransport
from podmigrate.transport.base import Sent, Transport
from podmigrate.transport.registry import RegistryTransport
from podmigrate.transport.stream import StreamTransport

if TYPE_CHECKING:
    from typing import TypeAlias

    from podmigrate.runtime.base import Runtime

    NodeRuntime: TypeAlias = Runtime  # the agent never names a runtime: server.py picks it


class NodeAgent:
    """One lab node's agent: an HTTP API over its runtime ``rt`` and its checkpoint directory."""

    def __init__(
        self,
        app: App,
        rt: NodeRuntime,
        identity: tls.Files,
        checkpoints: Path = Path(layout.NODE_CHECKPOINTS),
        notice: Path = Path(layout.NODE_NOTICE),
        peers: Peers | None = None,
    ):
        self.app, self.rt, self.identity = app, rt, identity
        self.peers = peers or Peers(app.name)
        self.files = CheckpointDir(checkpoints)
        self.memory = Reservations()
        self.notice = SpotNotice(notice)
        self.registry = RegistryTransport()
        # the engine's stream and archive transports both arrive at /send: on this side they differ
        # only in whether the export still holds the memory pages (no page server took them)
        client = identity.client()
        self.stream = StreamTransport(client, layout.AGENT_PORT)
        self.archive = ArchiveTransport(client, layout.AGENT_PORT)
        self.keys: dict[str, str] = {}  # checkpoint id -> its migration's seal key (memory only)
        self.prefetches = Prefetches(self.files, self.stream, lambda cid: safe_id(cid) in self.keys)
        self.lazy = LazyPages(self.peers, rt, self.files, self.memory, self.criu_tls, self.prefetches)

    def criu_tls(self, b: dict[str, Any], *, server: bool) -> tuple[str, ...]:
        return self.identity.criu(server=server) if tls.criu_tls_wanted(b) else ()

    def register(self) -> None:
        for method, pattern, fn in (
            ("GET", "/v1/info", self.info),
            ("GET", "/v1/containers", self.containers),
            ("POST", "/v1/containers", self.run),
            ("POST", "/v1/pods", self.pod),
            ("GET", "/v1/pods/(?P<pod>[^/]+)", self.pod_info),
            ("POST", "/v1/pods/(?P<pod>[^/]+)/checkpoint", self.pod_checkpoint),
            ("POST", "/v1/pods/(?P<pod>[^/]+)/restore-in-place", self.pod_restore_in_place),
            ("POST", "/v1/pods/(?P<pod>[^/]+)/restore", self.pod_restore),
            ("POST", "/v1/checkpoints/(?P<cid>[^/]+)/send-pod", self.send_pod),
            ("DELETE", "/v1/containers/(?P<name>[^/]+)", self.remove),
            ("POST", "/v1/containers/(?P<name>[^/]+)/checkpoint", self.checkpoint),
            ("POST", "/v1/containers/(?P<name>[^/]+)/restore", self.restore_local),
            ("POST", "/v1/checkpoints/(?P<cid>[^/]+)/restore", self.restore_archive),
            ("POST", "/v1/checkpoints/(?P<cid>[^/]+)/push", self.push),
            ("POST", "/v1/checkpoints/(?P<cid>[^/]+)/pull", self.pull),
            ("POST", "/v1/checkpoints/(?P<cid>[^/]+)/seal", self.expect_seal),
            ("POST", "/v1/checkpoints/(?P<cid>[^/]+)/send", self.send),
            ("POST", "/v1/containers/(?P<name>[^/]+)/resume", self.resume),
            ("GET", "/v1/containers/(?P<name>[^/]+)/spec", self.spec),
            ("GET", "/v1/containers/(?P<name>[^/]+)/memory", self.rss),
            ("POST", "/v1/containers/(?P<name>[^/]+)/stop", self.stop),
            ("POST", "/v1/containers/(?P<name>[^/]+)/start", self.start),
            ("POST", "/v1/containers/(?P<name>[^/]+)/retire", self.retire),
            ("POST", "/v1/containers/(?P<name>[^/]+)/rename", self.rename),
            ("DELETE", "/v1/checkpoints/(?P<cid>[^/]+)", self.delete),
            ("GET", "/v1/checkpoints", self.listing),
            ("POST", "/v1/registry/delete", self.registry_delete),
        ):
            self.app.route(method, pattern)(fn)
        # what another node's agent sends here: a checkpoint stream and its commit, nothing else
        self.app.route("PUT", "/v1/checkpoints/(?P<cid>[^/]+)", peer=True)(self.upload)
        self.app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/commit", peer=True)(self.commit)
        self.lazy.register(self.app)
        NodeImages(self.rt, self.files, self.stream, self.peers).register(self.app)
        self.memory.register(self.app)
        self.notice.register(self.app)

    # ------------------------------------------------------------------ containers and pods
    def info(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        # the checkpoints' directory is made by the first checkpoint; its file system is known before
        free = shutil.disk_usage(next(d for d in (self.files.root, *self.files.root.parents) if d.exists()))
        return {
            "name": self.app.name,
            "role": self.app.role,
            "ip": self.peers.mine(),
            "pid": os.getpid(),
            "started": self.app.started,
            "disk_free_bytes": free.free,
            "mem_available_bytes": _mem_available(),
            "cpuinfo": self.rt.cpuinfo(),
            **self.rt.info(),
        }

    def containers(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.list_containers()

    def run(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        names.name(b.get("name"))
        self.rt.ensure_image(names.image(b.get("image")))
        return self.rt.run(b)  # type: ignore[arg-type]

    def pod(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.rt.create_pod(b["name"], b.get("network", layout.WORKLOAD_NETWORK))
        return {"name": b["name"]}

    def pod_info(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.pod_info(p["pod"])

    def pod_checkpoint(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        with self.files.busy(b["checkpoint_id"]):
            return self.rt.checkpoint_pod(
                p["pod"],
                self.files.members(b["checkpoint_id"], b["members"]),
                tcp_established=b.get("tcp_established", True),
                leave_running=bool(b.get("leave_running")),
            )

    def pod_restore_in_place(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.restore_pod_in_place(p["pod"], b["members"], tcp_established=b.get("tcp_established", True))

    def pod_restore(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        if b.get("image"):
            self.rt.ensure_image(b["image"])
        with self.files.busy(b["checkpoint_id"]):
            return self.rt.restore_pod(
                p["pod"],
                b.get("network", layout.WORKLOAD_NETWORK),
                b["ip"],
                self.files.members(b["checkpoint_id"], b["members"]),
                mac=b.get("mac"),
                tcp_established=b.get("tcp_established", True),
                fresh=b.get("fresh") or [],
            )

    def remove(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.rt.remove(p["name"])
        return {"removed": p["name"]}

    def resume(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.resume(p["name"])

    def spec(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.spec(p["name"])

    def rss(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"rss_bytes": self.rt.rss(p["name"])}

    def stop(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        t0 = time.time()
        self.rt.stop(p["name"], float(b.get("timeout", 2)))
        return {"started": t0, "ended": time.time()}

    def start(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.rt.start(p["name"])
        return {"started": p["name"]}

    def rename(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.rt.rename(p["name"], names.name(b.get("to"), "new container name"))
        return {"renamed": p["name"], "to": b["to"]}

    def retire(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """Remove a container that a newer copy elsewhere replaced, cut off from the network first,
        so that removing it sends no FIN or RST to clients whose connections moved on."""
        return self.rt.retire(p["name"], b.get("ips") or [])

    # ------------------------------------------------------------------ checkpoint and restore
    def checkpoint(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.lazy.collapses.wait(p["name"])  # no dump of memory the kernel is moving
        a = self.files.archive(b["checkpoint_id"])
        criu, relay = self.lazy.dump_to_page_server(b["checkpoint_id"], b)
        criu += network_lock(b)
        try:
            with self.files.busy(b["checkpoint_id"]):
                res = self.rt.checkpoint(
                    p["name"],
                    a,
                    tcp_established=b.get("tcp_established", True),
                    leave_running=b.get("leave_running", False) or bool(b.get("leave_stopped")),
                    criu=criu,
                )
        except RuntimeBackendError as e:
            if relay is not None:
                if relay.error:
                    e.details["page_relay"] = relay.error  # why CRIU's connection broke, when it was the relay
                relay.close()
            raise
        if relay is not None:
            relay.wait(10)  # CRIU has its answer: only the relay's own close is left
            relay.close()
            res["page_relay"] = {"bytes": relay.bytes, "started": relay.started, "ended": relay.ended}
        return {**res, "archive": str(a)}

    def restore_local(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.restore_local(p["name"], tcp_established=b.get("tcp_established", True))

    def restore_archive(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        if b.get("image"):
            b["image_pulled"] = self.rt.ensure_image(b["image"])
        cid = p["cid"]
        pages = self.files.pages(cid)
        self.memory.release(cid)  # if nothing released it yet
        if b.get("lazy_local") and pages.is_dir():
            try:
                return self.lazy.restore_from_pages(cid, b)
            except LazyPagesUnavailable as e:  # nothing restored yet: read the pages first instead
                print(f"restore of {cid}: {e}; restoring with the pages read first", file=sys.stderr, flush=True)
        self.lazy.speculations.stop(cid)  # a restore waiting at its gate holds the name: this one goes without
        # auto-dedup: CRIU punches each page out of the images once it is restored, so the page cache
        # the images fill is freed while the heap fills up and its (already touched) memory is reused,
        # instead of a second heap's worth of fresh memory (seconds per GB on a VM). Only here, on the
        # target: the source's own copy, which a rollback restores from, is never punched.
        criu: tuple[str, ...] = ("auto-dedup",)
        with self.files.busy(cid):
            if pages.is_dir():
                # the page server wrote the memory pages here; the rest of the images come in the archive
                untar = subprocess.run(
                    [
                        "tar",
                        "-C",
                        str(pages),
                        "-xf",
                        str(self.files.archive(cid)),
                        "--strip-components=1",
                        "checkpoint",
                    ],
                    capture_output=True,
                    text=True,
                )
                if untar.returncode:
                    raise RuntimeBackendError(f"unpacking checkpoint {cid} failed: {untar.stderr.strip()}")
                criu += (f"images-dir={pages}",)
            res = self.rt.restore_archive(
                self.files.archive(cid),
                tcp_established=b.get("tcp_established", True),
                criu=criu,
                network=str(b.get("copy_network", "keep")),
            )
        return {**res, "image_pulled": b.get("image_pulled", False)}

    def delete(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        cid = safe_id(p["cid"])
        self.keys.pop(cid, None)
        self.lazy.stop(cid)
        with self.files.busy(cid):
            existed = self.files.remove(cid)
        return {"deleted": existed}

    def listing(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.files.listing()

    # ------------------------------------------------------------------ moving checkpoints
    def _send(self, t: Transport, cid: str, archive: Path, to: str) -> Sent:
        with self.files.busy(cid):
            return t.send(archive, to)

    def push(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        archive, reference = self.files.archive(p["cid"]), b["reference"]
        image = RegistryTransport(b.get("annotations") or {}, b.get("compression", "none"), _seal(p["cid"], b))
        return self._send(image, p["cid"], archive, reference)

    def pull(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.memory.release(p["cid"])
        with self.files.busy(p["cid"]):
            return RegistryTransport(sealed=_seal(p["cid"], b)).fetch(b["reference"], self.files.archive(p["cid"]))

    def expect_seal(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """The key that uploads for checkpoint ``cid`` are sealed with (from the controller only:
        a peer agent never sends a key). Kept in memory until the checkpoint is deleted."""
        cid = safe_id(p["cid"])
        if len(self.keys) >= 256:  # a controller that never deleted its checkpoints
            self.keys.pop(next(iter(self.keys)))
        sealed = _seal(cid, b)
        if sealed is None:
            raise UsageError("a seal needs a key")
        self.keys[cid] = sealed.key
        return {"sealed": cid}

    def registry_delete(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        if b.get("checkpoint_id"):
            with self.files.busy(b["checkpoint_id"]):
                return {"deleted": self.registry.discard(b["reference"])}
        return {"deleted": self.registry.discard(b["reference"])}

    def send(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        target = b["node"]
        t = self.stream.with_seal(_seal(p["cid"], b))
        return self._send(t, p["cid"], self.files.archive(p["cid"]), self.peers.address(target))

    def send_pod(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        total, channel, t = 0, None, self.archive.with_seal(_seal(p["cid"], b))
        for _m, a in self.files.members(p["cid"], b["members"]).items():
            sent = self._send(t, p["cid"], a, self.peers.address(b["node"]))
            total, channel = total + sent["bytes"], sent.get("channel")  # the same way for every member
        return {"bytes": total, "sealed": t.sealed is not None, "channel": channel}

    def upload(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        self.memory.release(p["cid"])
        if "stream" not in b:
            raise UsageError("a checkpoint upload needs Content-Type: application/octet-stream")
        # a pod member's upload is <id>.<member>: the migration's key is the id's
        base = p["cid"].split(".", 1)[0]
        sealed_for = b["headers"].get(stream.SEALED_HEADER)
        key = self.keys.get(base)
        if sealed_for is not None and (sealed_for != base or key is None):
            raise TransportError(
                f"an upload of {p['cid']} sealed for {sealed_for!r}, which this agent has no key for; refused",
                hint="only the controller gives the target a migration's key; retry the migration",
            )
        if sealed_for is None and key is not None:
            raise TransportError(
                f"checkpoint {p['cid']} arrived unsealed, but its migration seals checkpoints; refused"
            )
        digest = b["headers"].get(stream.DIGEST_HEADER) == "sha256"
        sealed = stream.Seal(key, base, digest) if key is not None else None
        with self.files.busy(p["cid"]):
            return stream.receive(b["stream"], b["length"], self.files.archive(p["cid"]), sealed)

    def commit(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        with self.files.busy(p["cid"]):
            done = stream.commit(self.files.archive(p["cid"]), b.get("sha256"))
            if p["cid"].endswith(node_prefetch.SUFFIX):
                self.prefetches.unpack(p["cid"])
            return done


def _seal(cid: str, b: dict[str, Any]) -> stream.Seal | None:
    """The request's seal key (``"seal": hex``) for checkpoint ``cid``; None when it has none."""
    key = b.get("seal")
    if not key:
        return None
    return stream.Seal(seal.check_key(key), cid, bool(b.get("digest")))


def _mem_available() -> int | None:
    """The kernel's estimate of memory a new process can take without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None
