"""A FAKE lab for fast tests of the engine: in-process agents with the real agents' HTTP contract.

Everything a migration changes lives in one ``World``: containers per node (a heap digest, a counter
that advances with every answer, the time the process started), checkpoints per node, the registry's
images, the LAN's routes and probes. The agents are ``agent.http.App`` route tables (the real auth,
status codes and error shapes) over that world, reached through ``client.AgentClient`` on an
``httpx.MockTransport``: the controller cannot tell them from the real ones by their answers.

What it does not do: run CRIU, Podman or a network. The real lab tests (``-m lab``) prove those;
these prove the engine's phases, undos and crash recovery in milliseconds. Faults:
``World.fail(node, method, path_regex, ...)`` makes a call answer with an error, die in transit
(agent unreachable) or kill the controller (``ControllerDied``, a BaseException like SIGKILL's
effect on the process: nothing after it runs).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from podmigrate import layout
from podmigrate.agent import tls
from podmigrate.agent.http import App
from podmigrate.client import AgentClient
from podmigrate.engine.cluster import Cluster
from podmigrate.errors import PodmigrateError, RuntimeBackendError, TransportError, UsageError
from podmigrate.lab.cluster import AddressPlan, Lab
from podmigrate.transport import seal

TOKEN = "fake-token"
CAPABILITIES = {
    "runtime": "fake",
    "criu": "4.2.1",
    "lazy_pages": True,
    "page_server": True,
    "soft_dirty": False,
    "pods": True,
    "tcp_established": True,
}


class ControllerDied(BaseException):
    """The controller process died at this call (what SIGKILL does: no except clause runs)."""


@dataclass
class Container:
    name: str
    ip: str
    heap: str  # the heap's digest
    counter: int = 0
    started: float = field(default_factory=time.time)  # when its process started (kept by a restore)
    state: str = "running"  # running | exited
    frozen: bool = False  # dumped and left stopped, or network-locked
    id: str = ""

    def info(self) -> dict[str, Any]:
        labels = {"podmigrate.workload": "stream-server", "podmigrate.port": "8000", "podmigrate.probe": "/healthz"}
        return {
            "name": self.name,
            "id": self.id,
            "state": self.state,
            "image": "localhost/fake:1",
            "ips": [self.ip],
            "pod": None,
            "labels": labels,
        }

    def serves(self) -> bool:
        return self.state == "running" and not self.frozen

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "ip": self.ip, "heap": self.heap, "counter": self.counter, "started": self.started}


@dataclass
class Fault:
    node: str
    method: str
    path: re.Pattern[str]
    kind: str  # error | unreachable | die
    message: str
    times: int  # how many calls it hits (then it is gone)
    skip: int  # how many matching calls pass before it hits


@dataclass
class Node:
    name: str
    containers: dict[str, Container] = field(default_factory=dict)
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> snapshot
    reserved: set[str] = field(default_factory=set)  # checkpoint ids with memory warmed for them
    keys: dict[str, str] = field(default_factory=dict)  # checkpoint id -> seal key the controller gave
    lazy: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> source's lazy dump
    collapses: dict[str, dict[str, Any]] = field(default_factory=dict)  # container -> its huge pages' outcome
    facts: dict[str, Any] = field(default_factory=dict)  # overrides of what GET /v1/info reports


class World:
    def __init__(self, nodes: tuple[str, ...] = ("node-a", "node-b")):
        self.nodes = {n: Node(n) for n in nodes}
        self.registry: dict[str, dict[str, Any]] = {}
        self.routes: dict[str, str] = {}  # service address -> node IP
        self.probes: dict[str, list[dict[str, Any]]] = {}
        self.faults: list[Fault] = []
        self.calls: list[tuple[str, str, str]] = []
        self.bodies: list[tuple[str, str, str, dict[str, Any]]] = []  # the calls with what they asked for
        self._ids = itertools.count(1)
        self.apps = {n: self._node_app(n) for n in nodes} | {"lan": self._lan_app()}

    # --------------------------------------------------------------------------- test helpers
    def start(self, node: str, name: str, heap_mb: int = 64) -> Container:
        ip = f"10.89.{list(self.nodes).index(node) + 1}.{next(self._ids) + 10}"
        c = Container(name, ip, hashlib.sha256(f"{name}-{heap_mb}".encode()).hexdigest(), id=f"{name}-id-0")
        self.nodes[node].containers[name] = c
        self.routes[ip] = layout.node_ip(node)
        return c

    def fail(
        self, node: str, method: str, path: str, kind: str = "error", message: str = "", times: int = 1, skip: int = 0
    ) -> None:
        self.faults.append(Fault(node, method, re.compile(path), kind, message or f"injected {kind}", times, skip))

    def where(self, name: str) -> list[tuple[str, Container]]:
        return [(n.name, c) for n in self.nodes.values() for c in n.containers.values() if c.name == name]

    def serving(self, ip: str) -> tuple[str, Container] | None:
        """The container that answers at ``ip`` through the LAN's route, if any."""
        node = next((n for n in self.nodes if layout.node_ip(n) == self.routes.get(ip)), None)
        c = next((c for c in self.nodes[node].containers.values() if c.ip == ip), None) if node else None
        return (node, c) if node and c and c.serves() else None

    def leftovers(self) -> dict[str, Any]:
        """What a finished migration must not leave: archives, images, stopped copies, warmed memory,
        the LAN agent's probes."""
        return {
            "archives": {n: sorted(x.checkpoints) for n, x in self.nodes.items() if x.checkpoints},
            "images": sorted(self.registry),
            "stopped": [
                f"{n}/{c.name}" for n, x in self.nodes.items() for c in x.containers.values() if not c.serves()
            ],
            "reserved": {n: sorted(x.reserved) for n, x in self.nodes.items() if x.reserved},
            "lazy": {n: sorted(x.lazy) for n, x in self.nodes.items() if x.lazy},
            "probes": sorted(self.probes),  # a probe left running goes on for its whole lease
        }

    # ------------------------------------------------------------------------------ transport
    def transport(self, agent: str) -> httpx.MockTransport:
        app = self.apps[agent]

        def handle(request: httpx.Request) -> httpx.Response:
            self.calls.append((agent, request.method, request.url.path))
            for f in self.faults:
                if f.node == agent and f.method == request.method and f.path.search(request.url.path) and f.times:
                    if f.skip:
                        f.skip -= 1
                        continue
                    f.times -= 1
                    if f.kind == "signal":  # delivered to this process; its handler runs in the main thread
                        for name in f.message.split(","):
                            os.kill(os.getpid(), getattr(signal, name))
                        break
                    if f.kind == "die":
                        raise ControllerDied(f"{f.message} ({request.method} {request.url.path} on {agent})")
                    if f.kind == "unreachable":
                        raise httpx.ConnectError(f.message, request=request)
                    err = RuntimeBackendError(f.message, details={"node": agent})
                    return httpx.Response(500, json={"error": err.to_wire()})
            body = request.read()
            self.bodies.append((agent, request.method, request.url.path, json.loads(body) if body else {}))
            status, data = app.dispatch(
                request.method,
                request.url.path,
                request.headers.get("Authorization"),
                lambda: json.loads(body) if body else {},
            )
            return httpx.Response(status, json=data)

        return httpx.MockTransport(handle)

    # -------------------------------------------------------------------------------- agents
    def _node_app(self, name: str) -> App:
        app = App(name, "node", TOKEN)
        node = self.nodes[name]

        def container(n: str) -> Container:
            if n not in node.containers:
                raise RuntimeBackendError(f"no container with name or ID {n!r} found", details={"node": name})
            return node.containers[n]

        def restore_from(snap: dict[str, Any]) -> dict[str, Any]:
            if snap.get("broken"):
                raise RuntimeBackendError("criu restore failed: corrupt image", details={"node": name})
            c = Container(snap["name"], snap["ip"], snap["heap"], snap["counter"], snap["started"])
            c.id = f"{c.name}-id-{next(self._ids)}"
            node.containers[c.name] = c
            return {"stats": {"restore_time": 1000}, "started": time.time(), "ended": time.time()}

        @app.route("GET", "/v1/info")
        def info(p: dict[str, str], b: dict[str, Any]) -> Any:
            return {"name": name, "criu": "4.2.1", "podman": "5.4.2", "runc": "1.3.0", "disk_free_bytes": 10 << 30,
                    "mem_available_bytes": 16 << 30, "capabilities": dict(CAPABILITIES), **node.facts}  # fmt: skip

        @app.route("POST", "/v1/cpuinfo/check")
        def cpuinfo_check(p: dict[str, str], b: dict[str, Any]) -> Any:
            ok = b["image"] in node.facts.get("runs_cpus", [node.facts.get("cpuinfo")])
            return {"why": None if ok else "cpu: x86 features mismatch (avx512f)"}

        @app.route("GET", "/v1/containers")
        def containers(p: dict[str, str], b: dict[str, Any]) -> Any:
            return [c.info() for c in node.containers.values()]

        @app.route("GET", "/v1/containers/(?P<n>[^/]+)/spec")
        def spec(p: dict[str, str], b: dict[str, Any]) -> Any:
            c = container(p["n"])
            return {"name": c.name, "image": "localhost/fake:1", "ip": c.ip, "heap": c.heap}

        @app.route("GET", "/v1/containers/(?P<n>[^/]+)/memory")
        def memory(p: dict[str, str], b: dict[str, Any]) -> Any:
            container(p["n"])
            return {"rss_bytes": 128 << 20}

        @app.route("POST", "/v1/images")
        def image(p: dict[str, str], b: dict[str, Any]) -> Any:
            return {"image": b["image"], "pulled": False, "seconds": 0.0}

        @app.route("POST", "/v1/containers")
        def run(p: dict[str, str], b: dict[str, Any]) -> Any:  # cold: a fresh process, same heap seed
            c = Container(b["name"], b["ip"], b["heap"], id=f"{b['name']}-id-{next(self._ids)}")
            node.containers[c.name] = c
            return c.info()

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/reserve-memory")
        def reserve(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.reserved.add(p["cid"])
            return {"bytes": b["bytes"]}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/release-memory")
        def release(p: dict[str, str], b: dict[str, Any]) -> Any:
            had = p["cid"] in node.reserved
            node.reserved.discard(p["cid"])
            return {"released": had}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/checkpoint")
        def checkpoint(p: dict[str, str], b: dict[str, Any]) -> Any:
            c = container(p["n"])
            t0 = time.time()
            node.checkpoints[b["checkpoint_id"]] = c.snapshot()
            if b.get("page_server"):  # the pages went into the target's page server during the dump
                target = next(n for n in self.nodes.values() if b["checkpoint_id"] in n.checkpoints and n is not node)
                target.checkpoints[b["checkpoint_id"]]["pages"] = True
            if b.get("leave_stopped"):
                c.frozen = True
            elif not b.get("leave_running"):
                c.state = "exited"  # podman --keep: restorable in place
            return {"started": t0, "ended": time.time(), "stats": {"pages_written": 16384}, "archive_bytes": 1 << 20}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/resume")
        def resume(p: dict[str, str], b: dict[str, Any]) -> Any:
            c = container(p["n"])
            c.frozen = False
            return {"woken": [1], "unlocked": ["CRIU-0d8f2b1c"]}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/restore")
        def restore_in_place(p: dict[str, str], b: dict[str, Any]) -> Any:
            container(p["n"]).state = "running"
            return {"stats": {}}

        @app.route("DELETE", "/v1/checkpoints/(?P<cid>[^/]+)")
        def delete(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.lazy.pop(p["cid"], None)
            return {"deleted": node.checkpoints.pop(p["cid"], None) is not None}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/push")
        def push(p: dict[str, str], b: dict[str, Any]) -> Any:
            if p["cid"] not in node.checkpoints:
                raise UsageError(f"no checkpoint {p['cid']} on {name}")
            # as the real layer: sealed with the push's key, openable only with the same key
            self.registry[b["reference"]] = {**node.checkpoints[p["cid"]], "_seal": b.get("seal")}
            digest = "sha256:" + hashlib.sha256(json.dumps(self.registry[b["reference"]]).encode()).hexdigest()
            return {"reference": b["reference"], "manifest_digest": digest, "layer_digest": digest, "bytes": 1 << 20,
                    "sealed": bool(b.get("seal"))}  # fmt: skip

        @app.route("POST", "/v1/registry/delete")
        def registry_delete(p: dict[str, str], b: dict[str, Any]) -> Any:
            return {"deleted": self.registry.pop(b["reference"], None) is not None}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/pull")
        def pull(p: dict[str, str], b: dict[str, Any]) -> Any:
            snap = self.registry.get(b["reference"])
            if snap is None:
                raise PodmigrateError(f"manifest unknown: {b['reference']}")
            if snap.get("_seal") != b.get("seal"):
                raise TransportError(f"{b['reference']} is not sealed for this migration; refusing it")
            node.reserved.discard(p["cid"])
            node.checkpoints[p["cid"]] = {k: v for k, v in snap.items() if k != "_seal"}
            digest = "sha256:" + hashlib.sha256(json.dumps(snap).encode()).hexdigest()
            return {"layer_digest": digest, "bytes": 1 << 20, "sealed": bool(b.get("seal"))}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/send")
        def send(p: dict[str, str], b: dict[str, Any]) -> Any:
            t0 = time.time()
            target = self.nodes[b["node"]]
            if target.keys.get(p["cid"]) != b.get("seal"):  # the real target cannot open it either
                raise TransportError(f"{b['node']} has no key for the sealed checkpoint {p['cid']}")
            target.reserved.discard(p["cid"])  # the real agent frees it as the upload starts
            target.checkpoints[p["cid"]] = {**target.checkpoints.get(p["cid"], {}), **node.checkpoints[p["cid"]]}
            return {"bytes": 1 << 20, "sha256": None if b.get("seal") else "0" * 64, "sealed": bool(b.get("seal")),
                    "channel": "mutual TLS (TLSv1.3)", "started": t0, "ended": time.time()}  # fmt: skip

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/seal")
        def expect_seal(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.keys[p["cid"]] = b["seal"]
            return {"sealed": p["cid"]}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/page-server")
        def page_server(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.reserved.discard(p["cid"])
            node.checkpoints[p["cid"]] = {}
            if b.get("relay"):  # as the real agent: the relay needs the migration's key
                seal.check_key(b.get("seal"))
                return {"address": layout.node_ip(name), "port": 27000, "relay": True, "criu_tls": False}
            return {"address": layout.node_ip(name), "port": 27000, "relay": False, "criu_tls": tls.criu_tls_wanted(b)}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/restore")
        def restore(p: dict[str, str], b: dict[str, Any]) -> Any:
            if p["cid"] not in node.checkpoints:
                raise RuntimeBackendError(f"no checkpoint {p['cid']} on {name}", details={"node": name})
            out = restore_from(node.checkpoints[p["cid"]])
            if b.get("lazy_local") and node.checkpoints[p["cid"]].get("pages"):
                node.lazy[p["cid"]] = {"running": False, "rc": 0}  # its local daemon copies every page at once
                return {**out, "lazy_local": True}
            return out

        @app.route("DELETE", "/v1/containers/(?P<n>[^/]+)")
        def remove(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.containers.pop(p["n"], None)
            return {"removed": p["n"]}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/retire")
        def retire(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.containers.pop(p["n"], None)
            return {"retired": p["n"]}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/stop")
        def stop(p: dict[str, str], b: dict[str, Any]) -> Any:
            container(p["n"]).state = "exited"
            return {"started": time.time()}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/rename")
        def rename(p: dict[str, str], b: dict[str, Any]) -> Any:
            c = container(p["n"])
            node.containers.pop(c.name)
            c.name = b["to"]
            node.containers[c.name] = c
            return {"renamed": p["n"], "to": c.name}

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/start")
        def start(p: dict[str, str], b: dict[str, Any]) -> Any:
            c = container(p["n"])
            c.state, c.counter, c.started = "running", 0, time.time()
            return c.info()

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/checkpoint-lazy")
        def checkpoint_lazy(p: dict[str, str], b: dict[str, Any]) -> Any:
            c = container(p["n"])
            c.frozen = True
            node.lazy[b["checkpoint_id"]] = {"running": True, "rc": None}
            node.checkpoints[b["checkpoint_id"]] = c.snapshot()
            t = time.time()
            relay = bool(b.get("relay") and b.get("seal"))  # as the agent: relayed only with the key
            return {"started": t, "ended": t, "address": layout.node_ip(name), "port": 27001, "times": {},
                    "stats": {}, "archive_bytes": 1 << 20, "relay": relay, "criu_port": 27002}  # fmt: skip

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/abort-lazy")
        def abort_lazy(p: dict[str, str], b: dict[str, Any]) -> Any:
            node.lazy.pop(p["cid"], None)
            for c in node.containers.values():
                c.frozen = False  # CRIU thaws the tasks (its network lock stays: resume lifts it)
            return {"rc": 1}

        @app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/restore-lazy")
        def restore_lazy(p: dict[str, str], b: dict[str, Any]) -> Any:
            out = restore_from(node.checkpoints[p["cid"]])
            node.lazy[p["cid"]] = {"running": False, "rc": 0}  # the fake moves every page at once
            source = next(n for n in self.nodes.values() if p["cid"] in n.lazy and n is not node)
            source.lazy[p["cid"]] = {"running": False, "rc": 0}
            source.containers.pop(node.checkpoints[p["cid"]]["name"], None)  # CRIU ends it once the pages moved
            if b.get("relay") and not b.get("seal"):
                raise UsageError("a relayed lazy restore needs the migration's key")
            relay = bool(b.get("relay"))
            return {**out, "wake_faults": b.get("wake_faults", False), "relay": relay,
                    "criu_tls": not relay and tls.criu_tls_wanted(b)}  # fmt: skip

        @app.route("POST", "/v1/containers/(?P<n>[^/]+)/huge-pages")
        def huge_pages(p: dict[str, str], b: dict[str, Any]) -> Any:
            container(p["n"])
            done = {"mode": "madvise", "ranges": 0, "bytes": 0, "collapsed_bytes": 0, "failed": {}, "seconds": 0.0}
            node.collapses[p["n"]] = {**done, "state": "done"}  # at once, where the agent's thread takes a while
            return {"state": "collapsing", "started": time.time()} if b.get("background") else node.collapses[p["n"]]

        @app.route("GET", "/v1/containers/(?P<n>[^/]+)/huge-pages")
        def huge_pages_status(p: dict[str, str], b: dict[str, Any]) -> Any:
            return node.collapses.get(p["n"], {"state": "none"})

        @app.route("GET", "/v1/checkpoints/(?P<cid>[^/]+)/lazy")
        def lazy_status(p: dict[str, str], b: dict[str, Any]) -> Any:
            st = node.lazy.get(p["cid"], {"running": False, "rc": None})
            return {"lan_tx_bytes": 0, "src": st, "dst": st}

        return app

    def _lan_app(self) -> App:
        app = App("lan", "lan", TOKEN)

        def answer(ip: str, path: str) -> tuple[bool, str]:
            found = self.serving(ip)
            if not found:
                return False, ""
            _, c = found
            c.counter += 1
            if path == "/state":
                return True, json.dumps({"sha256": c.heap, "counter": c.counter, "started": c.started, "heap_mb": 64})
            return True, "ok"

        @app.route("PUT", "/v1/routes/(?P<addr>[0-9.]+)")
        def switch(p: dict[str, str], b: dict[str, Any]) -> Any:
            t0 = time.time()
            self.routes[p["addr"]] = b["via"]
            return {"addr": p["addr"], "via": b["via"], "router": "route", "draining": False,
                    "started": t0, "ended": time.time()}  # fmt: skip

        @app.route("GET", "/v1/routes/(?P<addr>[0-9.]+)")
        def lookup(p: dict[str, str], b: dict[str, Any]) -> Any:
            return {"addr": p["addr"], "via": self.routes.get(p["addr"])}

        @app.route("POST", "/v1/http")
        def http_get(p: dict[str, str], b: dict[str, Any]) -> Any:
            m = re.match(r"http://([0-9.]+):\d+(/.*)", b["url"])
            ok, body = answer(m.group(1), m.group(2)) if m else (False, "")
            return {"ok": ok, "status": 200 if ok else None, "body": body}

        @app.route("POST", "/v1/probes")
        def probe(p: dict[str, str], b: dict[str, Any]) -> Any:
            pid = f"{next(self._ids):x}"
            self.probes[pid] = [{"host": b["host"]}]
            return {"id": pid}

        def sample(pid: str) -> list[dict[str, Any]]:
            # one probe per read: enough for the engine to see the service answer after the switch
            host = self.probes[pid][0]["host"]
            t = time.time()
            self.probes[pid].append({"sent": t, "answered": t + 0.001, "ok": answer(host, "/healthz")[0]})
            return self.probes[pid][1:]

        @app.route("GET", "/v1/probes/(?P<pid>[0-9a-f]+)")
        def read_probe(p: dict[str, str], b: dict[str, Any]) -> Any:
            return sample(p["pid"])

        @app.route("DELETE", "/v1/probes/(?P<pid>[0-9a-f]+)")
        @app.route("POST", "/v1/probes/(?P<pid>[0-9a-f]+)/stop")
        def stop_probe(p: dict[str, str], b: dict[str, Any]) -> Any:
            records = sample(p["pid"])
            del self.probes[p["pid"]]
            return records

        return app


class FakeLab(AddressPlan):
    """An ``engine.cluster.Cluster`` over a ``World``."""

    def __init__(self, directory: Path, world: World | None = None):
        self.name = "fake"
        self.dir = directory
        self.world = world or World()

    @property
    def nodes(self) -> list[str]:
        return list(self.world.nodes)

    def agent(self, name: str, timeout: float = 900.0) -> AgentClient:
        if name not in self.world.apps:
            raise UsageError(f"no agent {name!r} in the fake lab")
        return AgentClient(name, None, TOKEN, timeout, transport=self.world.transport(name))

    def require_up(self) -> None:
        pass


def _conforms(fake: FakeLab, lab: Lab) -> tuple[Cluster, Cluster]:
    return fake, lab  # mypy: the fake and the lab are both what the engine runs on
