"""Background load for the engine benchmark, as the study ran its migrations beside Online Boutique.

A handful of small services (``workload/mesh.py``, in the workload image) on every node, calling
each other at a stated rate: ``per_node`` services per node, each calling its node's other services
round robin at ``rate`` requests per second, with a SHA-256 over 16 KB per answer. They stay up for
the whole benchmark; a run without load sets their rate to 0 (idle processes, memory unchanged),
so that with and without alternate within one run. Only within a node: in the lab, each node has the
whole workload subnet on its own bridge, so a container reaches another node's containers only
through a service address the LAN routes, which these are not meant to be.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import time
from dataclasses import dataclass, field
from typing import Any

from podmigrate import layout
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.lab.cluster import Lab, Report
from podmigrate.workload import manage
from podmigrate.workload.image import ensure_workload_image

PREFIX = "pm-load"
PORT = 8000


@dataclass
class Load:
    lab: Lab
    rate: float
    services: dict[str, str] = field(default_factory=dict)  # name -> address

    def set_rate(self, rate: float) -> dict[str, Any]:
        """Every service at ``rate`` requests per second; their counters so far."""
        got = {}
        for name, ip in self.services.items():
            res = manage.lan_get(self.lab, f"http://{ip}:{PORT}/rate/{rate:g}", timeout=5)
            if not res.get("ok"):
                raise PodmigrateError(f"background load: {name} at {ip} did not take its rate: {res}")
            got[name] = json.loads(res["body"])
        return got

    def on(self) -> None:
        self.set_rate(self.rate)

    def off(self) -> None:
        self.set_rate(0)

    def stop(self) -> None:
        for name in self.services:
            with contextlib.suppress(PodmigrateError):
                manage.stop(self.lab, name)


def start(lab: Lab, per_node: int = 3, rate: float = 50.0, report: Report = lambda _m: None) -> Load:
    """``per_node`` mesh services on every node of ``lab``, idle until ``Load.on``."""
    if per_node < 2 or rate <= 0:
        raise UsageError("a background load needs at least 2 services per node and a positive rate")
    image = ensure_workload_image(lab, report)
    load = Load(lab, rate)
    try:
        for node in lab.nodes:
            base = ipaddress.ip_network(layout.node_range(node))
            ips = [str(base[240 + i]) for i in range(per_node)]  # high in the node's range, apart from others
            for i, ip in enumerate(ips):
                name = f"{PREFIX}-{node}-{i}"
                with contextlib.suppress(UsageError):
                    manage.stop(lab, name)  # left over from an interrupted benchmark
                peers = ",".join(f"{p}:{PORT}" for p in ips if p != ip)
                spec = {
                    "name": name,
                    "image": image,
                    "network": layout.WORKLOAD_NETWORK,
                    "ip": ip,
                    "command": ["python3", "-u", "/app/mesh.py"],
                    "env": {"PEERS": peers, "RATE": "0"},
                    "labels": {manage.LABEL_KIND: "mesh"},
                }
                agent = lab.agent(node)
                try:
                    agent.post("/v1/containers", spec)
                finally:
                    agent.close()
                manage.set_route(lab, ip, node)
                load.services[name] = ip
        deadline = time.monotonic() + 120
        for name, ip in load.services.items():
            while not manage.lan_get(lab, f"http://{ip}:{PORT}/healthz", timeout=2)["ok"]:
                if time.monotonic() > deadline:
                    raise PodmigrateError(f"background load: {name} at {ip} does not answer")
                time.sleep(0.2)
    except BaseException:
        load.stop()
        raise
    report(f"background load: {len(load.services)} services, {per_node} per node, {rate:g} requests/s each")
    return load
