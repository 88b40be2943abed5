"""The LAN agent's routes: the router, HTTP reads of service addresses, probes, held connections.

Standard library only. One per lab, on the LAN bridge's side; served by ``agent.server`` over
``agent.http``; routers from ``routing``, probes and connections from ``agent.probe``.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from podmigrate import layout, names, routing
from podmigrate.agent.http import App
from podmigrate.agent.probe import KeepAlive, Probe, fetch
from podmigrate.errors import UsageError
from podmigrate.routing import Router


class LanAgent:
    """The lab's router (chosen per lab and kept in ``router_file``, so a restarted agent keeps using
    it), its probers of service addresses and the client connections it holds open."""

    def __init__(self, app: App, router_file: str | None = None):
        self.app = app
        self.saved = Path(router_file) if router_file else None
        self.router: Router = routing.make(
            self.saved.read_text().strip() if self.saved and self.saved.exists() else "route"
        )
        # a router change must not interleave with a switch (which could land on the router being torn down)
        self.router_lock = threading.Lock()
        self.probes: dict[str, Probe] = {}
        self.conns: dict[str, KeepAlive] = {}

    def register(self) -> None:
        for method, pattern, fn in (
            ("GET", "/v1/info", self.info),
            ("GET", "/v1/router", self.get_router),
            ("PUT", "/v1/router", self.set_router),
            ("GET", "/v1/routes", self.routes),
            ("PUT", "/v1/routes/(?P<addr>[0-9.]+)", self.switch),
            ("POST", "/v1/routes/(?P<addr>[0-9.]+)/drain", self.end_drain),
            ("DELETE", "/v1/routes/(?P<addr>[0-9.]+)", self.unroute),
            ("GET", "/v1/routes/(?P<addr>[0-9.]+)", self.lookup),
            ("POST", "/v1/http", self.http_get),
            ("POST", "/v1/probes", self.start_probe),
            ("GET", "/v1/probes/(?P<pid>[0-9a-f]+)", self.read_probe),
            ("DELETE", "/v1/probes/(?P<pid>[0-9a-f]+)", self.stop_probe),
            ("POST", "/v1/probes/(?P<pid>[0-9a-f]+)/stop", self.stop_probe),
            ("POST", "/v1/connections", self.open_conn),
            ("GET", "/v1/connections/(?P<cid>[0-9a-f]+)", self.conn_status),
            ("DELETE", "/v1/connections/(?P<cid>[0-9a-f]+)", self.close_conn),
        ):
            self.app.route(method, pattern)(fn)

    def info(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {
            "name": self.app.name,
            "role": self.app.role,
            "pid": os.getpid(),
            "started": self.app.started,
            "router": self.router.name,
            "probes": len(self.probes),
        }

    # ------------------------------------------------------------------ router and routes
    def get_router(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"name": self.router.name, "services": self.router.services()}

    def set_router(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        name = str(b.get("name"))
        if name not in routing.NAMES:
            raise UsageError(f"no router named {name!r}", hint=f"choose one of: {', '.join(routing.NAMES)}")
        with self.router_lock:
            if name != self.router.name:
                self.router = routing.replace(self.router, name)
            if self.saved:
                self.saved.write_text(name + "\n")
        return self.get_router(p, b)

    def routes(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.router.routes()

    def switch(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        with self.router_lock:
            return {**self.router.switch(p["addr"], b["via"], bool(b.get("drain"))), "router": self.router.name}

    def end_drain(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.router.end_drain(p["addr"], float(b.get("timeout", 2.0)))

    def unroute(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        with self.router_lock:
            return {"removed": self.router.remove(p["addr"])}

    def lookup(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"addr": p["addr"], "via": self.router.lookup(p["addr"])}

    # ------------------------------------------------------------------ a client's view
    def http_get(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """GET a URL from the LAN, as a client of the service would: plain HTTP to a service address
        (the workload subnet, or a node's address for a host-network container: never its agent's
        port) or to the lab registry's read API, no redirects followed. Never a file or an agent: this
        agent reaches every address of the lab, and a request must not borrow that reach."""
        url = urllib.parse.urlsplit(str(b.get("url", "")))
        try:
            host = names.ipv4(url.hostname)
            port = url.port or 80
            nodes = {layout.node_ip(n) for n in layout.node_names(layout.MAX_NODES)}
            allowed = url.scheme == "http" and (
                layout.in_workload_subnet(host)
                or (host in nodes and port != layout.AGENT_PORT)
                or (f"{host}:{port}" == layout.REGISTRY and url.path.startswith("/v2/"))
            )
        except (UsageError, ValueError):
            allowed = False
        if not allowed:
            raise UsageError(
                f"/v1/http fetches http:// URLs of service addresses ({layout.WORKLOAD_SUBNET}, or a node's "
                f"address but not its agent's port) and the registry's /v2/ only, not {b.get('url')!r}"
            )
        target = (url.path or "/") + (f"?{url.query}" if url.query else "")
        return fetch(host, port, target, float(b.get("timeout", 10)))

    def start_probe(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        pr = Probe(
            b["host"],
            int(b["port"]),
            b.get("path", "/healthz"),
            float(b.get("interval", 0.02)),
            float(b.get("timeout", 1.0)),
        )
        self.probes[pr.id] = pr
        return {"id": pr.id}

    def read_probe(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        if p["pid"] not in self.probes:
            raise UsageError(f"no probe {p['pid']}")
        return self.probes[p["pid"]].snapshot()

    def stop_probe(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        pr = self.probes.pop(p["pid"], None)
        if pr is None:
            raise UsageError(f"no probe {p['pid']}")
        return pr.stop(wait=bool(b.get("wait", True)))

    def open_conn(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        try:
            ka = KeepAlive(b["host"], int(b["port"]), b.get("path", "/counter"), float(b.get("interval", 0.05)))
        except OSError as e:
            raise UsageError(f"cannot connect to {b['host']}:{b['port']}: {e}") from e
        self.conns[ka.id] = ka
        return ka.status()

    def conn_status(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        if p["cid"] not in self.conns:
            raise UsageError(f"no connection {p['cid']}")
        return self.conns[p["cid"]].status()

    def close_conn(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        ka = self.conns.pop(p["cid"], None)
        if ka is None:
            raise UsageError(f"no connection {p['cid']}")
        return ka.stop()
