"""The agent's HTTP server: routes, bearer-token auth, errors as JSON (standard library only).

Run as ``python3 -m podmigrate.agent.server --role node|lan --name NAME --uds PATH --tcp IP:PORT
--token-file PATH``. It listens on a Unix socket (how the host-side controller reaches it across
namespaces) and on TCP on the node's LAN address (agent to agent, and the DaemonSet's port). Every
request must carry ``Authorization: Bearer <token>``; errors travel as ``{"error": {...}}`` in the
shape of ``podmigrate.errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import mmap
import os
import re
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from podmigrate import layout, routing
from podmigrate.agent.probe import KeepAlive, Probe
from podmigrate.errors import AgentError, PodmigrateError, RuntimeBackendError, UsageError
from podmigrate.routing import Router
from podmigrate.runtime.podman import Podman
from podmigrate.runtime.uffd import FaultWaker
from podmigrate.transport import registry, stream

Handler = Callable[[dict[str, str], dict[str, Any]], Any]
STATUS = {"UsageError": 400, "AgentError": 502, "LabError": 503}
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class App:
    """A route table: (method, regex) -> handler(params, body)."""

    def __init__(self, name: str, role: str, token: str):
        self.name, self.role, self.token = name, role, token
        self.routes: list[tuple[str, re.Pattern[str], Handler]] = []
        self.started = time.time()

    def route(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.routes.append((method, re.compile(f"^{pattern}$"), fn))
            return fn

        return deco

    def dispatch(self, method: str, path: str, auth: str | None, load: Callable[[], dict[str, Any]]) -> tuple[int, Any]:
        """Route one request; ``load`` reads the body (JSON, or a raw stream for uploads) only
        after the token was checked."""
        if not hmac.compare_digest((auth or "").encode(), f"Bearer {self.token}".encode()):
            return 401, {
                "error": AgentError(
                    f"agent {self.name}: missing or wrong token", hint="use the lab's token file"
                ).to_wire()
            }
        path = path.split("?", 1)[0]
        for m, rx, fn in self.routes:
            match = rx.match(path)
            if match and m == method:
                try:
                    return 200, fn(match.groupdict(), load())
                except PodmigrateError as e:
                    e.details.setdefault("node", self.name)
                    return STATUS.get(type(e).__name__, 500), {"error": e.to_wire()}
                except Exception as e:
                    return 500, {
                        "error": AgentError(
                            f"agent {self.name}: {type(e).__name__}: {e}",
                            details={"traceback": traceback.format_exc()[-3000:], "node": self.name},
                        ).to_wire()
                    }
        return 404, {"error": UsageError(f"agent {self.name} has no {method} {path}").to_wire()}


def make_handler(app: App) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def address_string(self) -> str:
            return str(self.client_address[0]) if self.client_address else "unix"

        def _load(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            if self.headers.get("Content-Type") == "application/octet-stream":
                return {"stream": self.rfile, "length": n, "headers": dict(self.headers.items())}
            return json.loads(self.rfile.read(n)) if n else {}

        def _handle(self) -> None:
            status, data = app.dispatch(self.command, self.path, self.headers.get("Authorization"), self._load)
            if status != 200:
                self.close_connection = True  # an unread request body must not be parsed as a request
            out = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_DELETE = _handle

    return H


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _safe_id(value: str) -> str:
    if not _SAFE_ID.match(value):
        raise UsageError(f"not a valid checkpoint id: {value!r}")
    return value


def node_app(app: App) -> None:
    rt = Podman(app.name)
    ckdir = Path(layout.NODE_CHECKPOINTS)
    # One lock per checkpoint id: an undo (delete, registry delete) sent by a controller that gave up,
    # or by a later one recovering, waits for the operation still running on that checkpoint, instead
    # of racing it and letting it leave an image or an archive behind.
    locks: dict[str, threading.Lock] = {}
    locks_guard = threading.Lock()

    def busy(cid: str) -> threading.Lock:
        with locks_guard:
            return locks.setdefault(_safe_id(cid), threading.Lock())

    def archive(cid: str) -> Path:
        return ckdir / f"{_safe_id(cid)}.tar"

    def pages_dir(cid: str) -> Path:
        return ckdir / f"{_safe_id(cid)}.pages"

    # Memory made ready for an incoming restore. On a VM, the first touch of guest memory the
    # hypervisor has not backed yet (or took back: free page reporting) costs seconds per GB, and a
    # restore writes a whole heap into fresh pages. Touching that much memory before the source
    # freezes, and freeing it as the checkpoint's bytes start to arrive (page server, pull, upload)
    # lets their page cache, and then the restore (auto-dedup recycles that cache), reuse backed pages.
    reserved: dict[str, mmap.mmap] = {}
    reserve_guard = threading.Lock()

    def release(cid: str) -> bool:
        with reserve_guard:
            m = reserved.pop(cid, None)
        if m is not None:
            m.close()
        return m is not None

    @app.route("GET", "/v1/info")
    def info(p: dict[str, str], b: dict[str, Any]) -> Any:
        free = shutil.disk_usage(ckdir)
        return {
            "name": app.name,
            "role": app.role,
            "ip": layout.node_ip(app.name),
            "pid": os.getpid(),
            "started": app.started,
            "disk_free_bytes": free.free,
            **rt.info(),
        }

    @app.route("GET", "/v1/containers")
    def containers(p: dict[str, str], b: dict[str, Any]) -> Any:
        return rt.list_containers()

    @app.route("POST", "/v1/containers")
    def run(p: dict[str, str], b: dict[str, Any]) -> Any:
        rt.ensure_image(b["image"])
        return rt.run(b)  # type: ignore[arg-type]

    @app.route("POST", "/v1/images")
    def ensure_image(p: dict[str, str], b: dict[str, Any]) -> Any:
        t0 = time.time()
        return {"image": b["image"], "pulled": rt.ensure_image(b["image"]), "seconds": time.time() - t0}

    @app.route("POST", "/v1/pods")
    def pod(p: dict[str, str], b: dict[str, Any]) -> Any:
        rt.create_pod(b["name"], b.get("network", layout.WORKLOAD_NETWORK))
        return {"name": b["name"]}

    def member_archives(cid: str, members: list[str]) -> dict[str, Path]:
        return {m: archive(f"{cid}.{_safe_id(m)}") for m in members}

    @app.route("GET", "/v1/pods/(?P<pod>[^/]+)")
    def pod_info(p: dict[str, str], b: dict[str, Any]) -> Any:
        return rt.pod_info(p["pod"])

    @app.route("POST", "/v1/pods/(?P<pod>[^/]+)/checkpoint")
    def pod_checkpoint(p: dict[str, str], b: dict[str, Any]) -> Any:
        with busy(b["checkpoint_id"]):
            return rt.checkpoint_pod(
                p["pod"],
                member_archives(b["checkpoint_id"], b["members"]),
                tcp_established=b.get("tcp_established", True),
                leave_running=bool(b.get("leave_running")),
            )

    @app.route("POST", "/v1/pods/(?P<pod>[^/]+)/restore-in-place")
    def pod_restore_in_place(p: dict[str, str], b: dict[str, Any]) -> Any:
        return rt.restore_pod_in_place(p["pod"], b["members"], tcp_established=b.get("tcp_established", True))

    @app.route("POST", "/v1/pods/(?P<pod>[^/]+)/restore")
    def pod_restore(p: dict[str, str], b: dict[str, Any]) -> Any:
        if b.get("image"):
            rt.ensure_image(b["image"])
        with busy(b["checkpoint_id"]):
            return rt.restore_pod(
                p["pod"],
                b.get("network", layout.WORKLOAD_NETWORK),
                b["ip"],
                member_archives(b["checkpoint_id"], b["members"]),
                mac=b.get("mac"),
                tcp_established=b.get("tcp_established", True),
                fresh=b.get("fresh") or [],
            )

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/send-pod")
    def send_pod(p: dict[str, str], b: dict[str, Any]) -> Any:
        total = 0
        for _m, a in member_archives(p["cid"], b["members"]).items():
            with busy(p["cid"]):
                total += stream.send(
                    a, layout.node_ip(b["node"]), layout.AGENT_PORT, a.name[: -len(".tar")], app.token
                )["bytes"]
        return {"bytes": total}

    @app.route("DELETE", "/v1/containers/(?P<name>[^/]+)")
    def remove(p: dict[str, str], b: dict[str, Any]) -> Any:
        rt.remove(p["name"])
        return {"removed": p["name"]}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/checkpoint")
    def checkpoint(p: dict[str, str], b: dict[str, Any]) -> Any:
        a = archive(b["checkpoint_id"])
        criu: tuple[str, ...] = ()
        if b.get("page_server"):
            ps = b["page_server"]
            criu = ("page-server", f"address={ps['address']}", f"port={ps['port']}")
            if b.get("leave_stopped"):
                criu += ("leave-stopped",)
        with busy(b["checkpoint_id"]):
            res = rt.checkpoint(
                p["name"],
                a,
                tcp_established=b.get("tcp_established", True),
                leave_running=b.get("leave_running", False) or bool(b.get("leave_stopped")),
                criu=criu,
            )
        return {**res, "archive": str(a)}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/restore")
    def restore_local(p: dict[str, str], b: dict[str, Any]) -> Any:
        return rt.restore_local(p["name"], tcp_established=b.get("tcp_established", True))

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/restore")
    def restore_archive(p: dict[str, str], b: dict[str, Any]) -> Any:
        if b.get("image"):
            b["image_pulled"] = rt.ensure_image(b["image"])
        pages = pages_dir(p["cid"])
        # auto-dedup: CRIU punches each page out of the images once it is restored, so the page cache
        # the images fill is freed while the heap fills up and its (already touched) memory is reused,
        # instead of a second heap's worth of fresh memory (seconds per GB on a VM). Only here, on the
        # target: the source's own copy, which a rollback restores from, is never punched.
        criu: tuple[str, ...] = ("auto-dedup",)
        release(p["cid"])  # if nothing released it yet
        with busy(p["cid"]):
            if pages.is_dir():
                # the page server wrote the memory pages here; the rest of the images come in the archive
                untar = subprocess.run(
                    ["tar", "-C", str(pages), "-xf", str(archive(p["cid"])), "--strip-components=1", "checkpoint"],
                    capture_output=True,
                    text=True,
                )
                if untar.returncode:
                    raise RuntimeBackendError(f"unpacking checkpoint {p['cid']} failed: {untar.stderr.strip()}")
                criu += (f"images-dir={pages}",)
            res = rt.restore_archive(archive(p["cid"]), tcp_established=b.get("tcp_established", True), criu=criu)
        return {**res, "image_pulled": b.get("image_pulled", False)}

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/push")
    def push(p: dict[str, str], b: dict[str, Any]) -> Any:
        with busy(p["cid"]):
            return registry.push_checkpoint(
                archive(p["cid"]), b["reference"], b.get("annotations") or {}, b.get("compression", "none")
            )

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/pull")
    def pull(p: dict[str, str], b: dict[str, Any]) -> Any:
        release(p["cid"])
        with busy(p["cid"]):
            return registry.pull_checkpoint(b["reference"], archive(p["cid"]))

    @app.route("PUT", "/v1/checkpoints/(?P<cid>[^/]+)")
    def upload(p: dict[str, str], b: dict[str, Any]) -> Any:
        release(p["cid"])
        if "stream" not in b:
            raise UsageError("a checkpoint upload needs Content-Type: application/octet-stream")
        with busy(p["cid"]):
            return stream.receive(b["stream"], b["length"], archive(p["cid"]))

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/commit")
    def commit(p: dict[str, str], b: dict[str, Any]) -> Any:
        with busy(p["cid"]):
            return stream.commit(archive(p["cid"]), b["sha256"])

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/send")
    def send(p: dict[str, str], b: dict[str, Any]) -> Any:
        target = b["node"]
        with busy(p["cid"]):
            return stream.send(archive(p["cid"]), layout.node_ip(target), layout.AGENT_PORT, p["cid"], app.token)

    # CRIU processes that run on after their request returned (the page server receiving a dump, the
    # source's lazy dump serving pages, the target's lazy-pages daemon), by role and checkpoint id
    jobs: dict[str, subprocess.Popen[Any]] = {}
    lazy_ports: dict[str, int] = {}
    wakers: dict[str, FaultWaker] = {}

    def free_port() -> int:
        with socket.socket() as sk:
            sk.bind((layout.node_ip(app.name), 0))
            return int(sk.getsockname()[1])

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/page-server")
    def page_server(p: dict[str, str], b: dict[str, Any]) -> Any:
        """Start a CRIU page server that receives the memory pages of checkpoint ``cid``."""
        release(p["cid"])
        port = free_port()  # the page server takes it right after
        jobs[f"ps-{p['cid']}"] = rt.page_server(pages_dir(p["cid"]), layout.node_ip(app.name), port)
        return {"address": layout.node_ip(app.name), "port": port}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/checkpoint-lazy")
    def checkpoint_lazy(p: dict[str, str], b: dict[str, Any]) -> Any:
        cid = b["checkpoint_id"]
        port = free_port()
        t0 = time.time()
        with busy(cid):
            jobs[f"src-{cid}"], times = rt.lazy_checkpoint(
                p["name"], archive(cid), layout.node_ip(app.name), port, tcp_established=b.get("tcp_established", True)
            )
        lazy_ports[cid] = port
        return {
            "address": layout.node_ip(app.name),
            "port": port,
            "started": t0,
            "times": times,
            "ended": time.time(),
            "archive_bytes": archive(cid).stat().st_size,
            "stats": {},
        }

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/restore-lazy")
    def restore_lazy(p: dict[str, str], b: dict[str, Any]) -> Any:
        cid = p["cid"]
        if b.get("image"):
            rt.ensure_image(b["image"])
        with busy(cid):
            res, daemon, waker = rt.lazy_restore(
                archive(cid),
                pages_dir(cid),
                ckdir / f"{_safe_id(cid)}.work",
                b["address"],
                int(b["port"]),
                tcp_established=b.get("tcp_established", True),
                wake_faults=b.get("wake_faults", True),
            )
        jobs[f"dst-{cid}"] = daemon
        if waker:
            wakers[cid] = waker
        return {**res, "wake_faults": waker is not None}

    @app.route("GET", "/v1/checkpoints/(?P<cid>[^/]+)/lazy")
    def lazy_status(p: dict[str, str], b: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        for role in ("src", "dst"):
            job = jobs.get(f"{role}-{p['cid']}")
            if job is not None:
                out[role] = {"running": job.poll() is None, "rc": job.returncode}
        if p["cid"] in wakers:
            out["waker"] = wakers[p["cid"]].status()
        # bytes this node sent on its LAN link: across a post-copy, the pages its dump served
        # (/proc/net/dev, not /sys/class/net: sysfs shows the netns of whoever mounted it)
        with contextlib.suppress(OSError, ValueError, IndexError):
            line = next(
                ln for ln in Path("/proc/self/net/dev").read_text().splitlines() if ln.strip().startswith("eth0:")
            )
            out["lan_tx_bytes"] = int(line.split(":", 1)[1].split()[8])
        return out

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/abort-lazy")
    def abort_lazy(p: dict[str, str], b: dict[str, Any]) -> Any:
        """Make a lazy dump that no target is pulling from give up: CRIU's page server gets a request
        it does not know, fails, and then thaws the tasks and unlocks the network (its error path)."""
        job = jobs.get(f"src-{p['cid']}")
        if job is None or job.poll() is not None:
            return {"aborted": False, "rc": None if job is None else job.returncode}
        try:
            with socket.create_connection((layout.node_ip(app.name), lazy_ports[p["cid"]]), timeout=5) as sk:
                sk.sendall(b"\xff" * 64)
        except OSError:
            pass
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
        return {"aborted": True, "rc": job.returncode}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/resume")
    def resume(p: dict[str, str], b: dict[str, Any]) -> Any:
        return rt.resume(p["name"])

    @app.route("GET", "/v1/containers/(?P<name>[^/]+)/spec")
    def spec(p: dict[str, str], b: dict[str, Any]) -> Any:
        return rt.spec(p["name"])

    @app.route("GET", "/v1/containers/(?P<name>[^/]+)/memory")
    def memory(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"rss_bytes": rt.rss(p["name"])}

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/reserve-memory")
    def reserve_memory(p: dict[str, str], b: dict[str, Any]) -> Any:
        cid, n = _safe_id(p["cid"]), int(b["bytes"])
        if n <= 0 or n > os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE // 2:
            raise UsageError(f"will not reserve {n} bytes: at most half of this machine's memory")
        t0 = time.time()
        release(cid)
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m[:: mmap.PAGESIZE] = bytes(-(-n // mmap.PAGESIZE))  # one write per page backs it
        with reserve_guard:
            reserved[cid] = m
        # never held for long: a controller that died must not pin the memory
        threading.Timer(float(b.get("hold_s", 120)), release, args=(cid,)).start()
        return {"bytes": n, "seconds": round(time.time() - t0, 3)}

    @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/release-memory")
    def release_memory(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"released": release(_safe_id(p["cid"]))}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/stop")
    def stop(p: dict[str, str], b: dict[str, Any]) -> Any:
        t0 = time.time()
        rt.stop(p["name"], float(b.get("timeout", 2)))
        return {"started": t0, "ended": time.time()}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/start")
    def start(p: dict[str, str], b: dict[str, Any]) -> Any:
        rt.start(p["name"])
        return {"started": p["name"]}

    @app.route("POST", "/v1/containers/(?P<name>[^/]+)/retire")
    def retire(p: dict[str, str], b: dict[str, Any]) -> Any:
        """Remove a container that a newer copy elsewhere replaced, cut off from the network first,
        so that removing it sends no FIN or RST to clients whose connections moved on."""
        return rt.retire(p["name"], b.get("ips") or [])

    @app.route("DELETE", "/v1/checkpoints/(?P<cid>[^/]+)")
    def delete(p: dict[str, str], b: dict[str, Any]) -> Any:
        a = archive(p["cid"])
        for role in ("ps", "dst"):  # the source's lazy dump is never killed: abort-lazy ends it safely
            job = jobs.pop(f"{role}-{p['cid']}", None)
            if job is not None and job.poll() is None:
                job.kill()
                job.wait()
        waker = wakers.pop(p["cid"], None)
        if waker is not None:
            waker.stop()
        with busy(p["cid"]):
            shutil.rmtree(pages_dir(p["cid"]), ignore_errors=True)
            shutil.rmtree(ckdir / f"{_safe_id(p['cid'])}.work", ignore_errors=True)
            (ckdir / f"{_safe_id(p['cid'])}.tar.full").unlink(missing_ok=True)
            existed = a.exists()
            for f in (
                a,
                a.with_name(a.name + ".part"),
                a.with_name(a.name + ".part.sha256"),
                *ckdir.glob(f"{_safe_id(p['cid'])}.*.tar*"),
            ):
                f.unlink(missing_ok=True)
        return {"deleted": existed}

    @app.route("GET", "/v1/checkpoints")
    def listing(p: dict[str, str], b: dict[str, Any]) -> Any:
        return [
            {"id": f.name.split(".", 1)[0], "file": f.name, "bytes": f.stat().st_size, "mtime": f.stat().st_mtime}
            for f in sorted(ckdir.iterdir())
        ]

    @app.route("POST", "/v1/registry/delete")
    def reg_delete(p: dict[str, str], b: dict[str, Any]) -> Any:
        if b.get("checkpoint_id"):
            with busy(b["checkpoint_id"]):
                return {"deleted": registry.delete_checkpoint(b["reference"])}
        return {"deleted": registry.delete_checkpoint(b["reference"])}


def lan_app(app: App, router_file: str | None = None) -> None:
    # the router is chosen per lab and kept in a file, so a restarted agent keeps using it
    saved = Path(router_file) if router_file else None
    current: list[Router] = [routing.make(saved.read_text().strip() if saved and saved.exists() else "route")]
    # a router change must not interleave with a switch (which could land on the router being torn down)
    router_lock = threading.Lock()
    probes: dict[str, Probe] = {}
    conns: dict[str, KeepAlive] = {}

    @app.route("GET", "/v1/info")
    def info(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {
            "name": app.name,
            "role": app.role,
            "pid": os.getpid(),
            "started": app.started,
            "router": current[0].name,
            "probes": len(probes),
        }

    @app.route("GET", "/v1/router")
    def get_router(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"name": current[0].name, "services": current[0].services()}

    @app.route("PUT", "/v1/router")
    def set_router(p: dict[str, str], b: dict[str, Any]) -> Any:
        name = str(b.get("name"))
        if name not in routing.NAMES:
            raise UsageError(f"no router named {name!r}", hint=f"choose one of: {', '.join(routing.NAMES)}")
        with router_lock:
            if name != current[0].name:
                current[0] = routing.replace(current[0], name)
            if saved:
                saved.write_text(name + "\n")
        return get_router(p, b)

    @app.route("GET", "/v1/routes")
    def routes(p: dict[str, str], b: dict[str, Any]) -> Any:
        return current[0].routes()

    @app.route("PUT", "/v1/routes/(?P<addr>[0-9.]+)")
    def switch(p: dict[str, str], b: dict[str, Any]) -> Any:
        with router_lock:
            return {**current[0].switch(p["addr"], b["via"], bool(b.get("drain"))), "router": current[0].name}

    @app.route("POST", "/v1/routes/(?P<addr>[0-9.]+)/drain")
    def end_drain(p: dict[str, str], b: dict[str, Any]) -> Any:
        return current[0].end_drain(p["addr"], float(b.get("timeout", 2.0)))

    @app.route("DELETE", "/v1/routes/(?P<addr>[0-9.]+)")
    def unroute(p: dict[str, str], b: dict[str, Any]) -> Any:
        with router_lock:
            return {"removed": current[0].remove(p["addr"])}

    @app.route("GET", "/v1/routes/(?P<addr>[0-9.]+)")
    def lookup(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"addr": p["addr"], "via": current[0].lookup(p["addr"])}

    @app.route("POST", "/v1/http")
    def http_get(p: dict[str, str], b: dict[str, Any]) -> Any:
        """GET a URL from the LAN, as a client of the service would."""
        t0 = time.time()
        try:
            with urllib.request.urlopen(b["url"], timeout=float(b.get("timeout", 10))) as r:
                body = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            body, status = e.read(), e.code
        except (OSError, ValueError) as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "elapsed": time.time() - t0}
        return {
            "ok": status == 200,
            "status": status,
            "body": body.decode(errors="replace"),
            "elapsed": time.time() - t0,
        }

    @app.route("POST", "/v1/probes")
    def start_probe(p: dict[str, str], b: dict[str, Any]) -> Any:
        pr = Probe(
            b["host"],
            int(b["port"]),
            b.get("path", "/healthz"),
            float(b.get("interval", 0.02)),
            float(b.get("timeout", 1.0)),
        )
        probes[pr.id] = pr
        return {"id": pr.id}

    @app.route("GET", "/v1/probes/(?P<pid>[0-9a-f]+)")
    def read_probe(p: dict[str, str], b: dict[str, Any]) -> Any:
        if p["pid"] not in probes:
            raise UsageError(f"no probe {p['pid']}")
        return probes[p["pid"]].snapshot()

    @app.route("DELETE", "/v1/probes/(?P<pid>[0-9a-f]+)")
    def stop_probe(p: dict[str, str], b: dict[str, Any]) -> Any:
        pr = probes.pop(p["pid"], None)
        if pr is None:
            raise UsageError(f"no probe {p['pid']}")
        return pr.stop()

    _connections(app, conns)


def _connections(app: App, conns: dict[str, KeepAlive]) -> None:
    @app.route("POST", "/v1/connections")
    def open_conn(p: dict[str, str], b: dict[str, Any]) -> Any:
        try:
            ka = KeepAlive(b["host"], int(b["port"]), b.get("path", "/counter"), float(b.get("interval", 0.05)))
        except OSError as e:
            raise UsageError(f"cannot connect to {b['host']}:{b['port']}: {e}") from e
        conns[ka.id] = ka
        return ka.status()

    @app.route("GET", "/v1/connections/(?P<cid>[0-9a-f]+)")
    def conn_status(p: dict[str, str], b: dict[str, Any]) -> Any:
        if p["cid"] not in conns:
            raise UsageError(f"no connection {p['cid']}")
        return conns[p["cid"]].status()

    @app.route("DELETE", "/v1/connections/(?P<cid>[0-9a-f]+)")
    def close_conn(p: dict[str, str], b: dict[str, Any]) -> Any:
        ka = conns.pop(p["cid"], None)
        if ka is None:
            raise UsageError(f"no connection {p['cid']}")
        return ka.stop()


def serve(args: argparse.Namespace) -> None:
    token = Path(args.token_file).read_text().strip()
    app = App(args.name, args.role, token)
    if args.role == "node":
        node_app(app)
    else:
        lan_app(app, args.router_file)
    handler = make_handler(app)
    servers: list[socketserver.BaseServer] = []
    if args.uds:
        Path(args.uds).unlink(missing_ok=True)
        tmp = args.uds + ".new"
        Path(tmp).unlink(missing_ok=True)
        us = UnixHTTPServer(tmp, handler)
        os.chmod(tmp, 0o600)
        os.rename(tmp, args.uds)  # appears only once it accepts connections
        servers.append(us)
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        ThreadingHTTPServer.allow_reuse_address = True
        ThreadingHTTPServer.daemon_threads = True
        ts = ThreadingHTTPServer((host, int(port)), handler)
        ts.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        servers.append(ts)
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(f"agent {args.name} ({args.role}) serving on {args.uds} and {args.tcp}", flush=True)
    servers[0].serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="podmigrate-agent")
    ap.add_argument("--role", choices=["node", "lan"], required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--uds")
    ap.add_argument("--tcp")
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--router-file", help="lan: where the lab's router choice is kept")
    args = ap.parse_args(argv)
    if not (args.uds or args.tcp):
        sys.exit("give --uds and/or --tcp")
    serve(args)


if __name__ == "__main__":
    main()
