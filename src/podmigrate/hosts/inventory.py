"""The hosts inventory: which machines podmigrate migrates between when they are not the lab.

A TOML file::

    state = "/var/lib/podmigrate/hosts"   # the controller's state directory (default, or relative: beside this file)
    registry = "registry.example:5000"    # optional: the registry transport needs one
    router = "none"                       # how a workload's address follows it: none | l2, or static as below
    network = "podman"                    # the containers' network on every host

    [hosts.host-a]
    address = "192.0.2.11"                # where the controller and the other agents reach its agent (TCP 7070)

    [hosts.host-b]
    address = "192.0.2.12"

Router static is a table instead, naming the machine that routes the service addresses to the hosts
(its agent, ``--role lan``, changes its routes; ``hosts init`` makes its bundle too)::

    [router]
    address = "192.0.2.1"

Every mistake is reported with the file, the key and what to write instead, before anything is made.
"""

from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podmigrate import layout, names
from podmigrate.errors import UsageError

ROUTERS = ("none", "static", "l2")
AGENT_PORT = layout.AGENT_PORT  # every agent's: they reach each other's there too
TOP = {"state", "registry", "router", "network", "hosts"}
ROUTER = "router"  # the static router's name: its certificate and bundle
HOST = {"address"}
CONTROLLER = layout.CONTROLLER  # the controller's certificate name: agents let it call every route


@dataclass(frozen=True)
class Host:
    name: str
    address: str


@dataclass(frozen=True)
class Inventory:
    path: Path
    state: Path
    hosts: tuple[Host, ...]
    registry: str | None
    router: str
    network: str
    router_address: str | None = None  # router static: its agent's address

    def machines(self) -> list[Host]:
        """Every machine with an agent: the hosts, then the static router if the inventory names one."""
        router = [Host(ROUTER, self.router_address)] if self.router_address else []
        return [*self.hosts, *router]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise UsageError(f"no host {name!r} in {self.path}", hint=f"its hosts: {', '.join(h.name for h in self.hosts)}")


def load(path: Path) -> Inventory:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"cannot read the inventory {path}: {e.strerror}", hint="give a TOML file's path") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path} is not TOML: {e}", hint="see docs/hosts.md for an example") from None
    return parse(doc, path)


def parse(doc: dict[str, Any], path: Path) -> Inventory:
    def bad(what: str, hint: str) -> UsageError:
        return UsageError(f"{path}: {what}", hint=hint)

    if unknown := sorted(set(doc) - TOP):
        raise bad(f"unknown keys {unknown}", f"the keys are {', '.join(sorted(TOP))}")
    hosts_doc = doc.get("hosts")
    if not isinstance(hosts_doc, dict) or len(hosts_doc) < 2:
        raise bad("fewer than two [hosts.NAME] tables", "name every host a workload may run on, two at least")
    hosts: list[Host] = []
    for name, h in hosts_doc.items():
        if not names.is_name(name):
            raise bad(f"host name {name!r} is not a valid name", "letters, digits, '_', '.' and '-', as a container's")
        if name == CONTROLLER:
            raise bad(f"host name {name!r} is the controller's", "name the host otherwise")
        if not isinstance(h, dict) or (unknown := sorted(set(h) - HOST)):
            raise bad(f"[hosts.{name}] has unknown keys {unknown if isinstance(h, dict) else h!r}",
                      f"the keys of a host are {', '.join(sorted(HOST))}")  # fmt: skip
        try:
            address = str(ipaddress.IPv4Address(str(h.get("address", ""))))
        except ValueError:
            raise bad(
                f"[hosts.{name}] address {h.get('address')!r} is not an IPv4 address (IPv6: not yet)",
                'for example address = "192.0.2.11": where the other hosts reach it',
            ) from None
        hosts.append(Host(name, address))
    if len({h.address for h in hosts}) < len(hosts):
        raise bad("two hosts have one address", "each host's agent needs its own address")
    router_doc = doc.get("router", "none")
    router_address = None
    if isinstance(router_doc, dict):  # [router]: the static router's agent
        router, raw = "static", router_doc.get("address", "")
        if unknown := sorted(set(router_doc) - {"address"}):
            raise bad(f"[router] has unknown keys {unknown}", "the key of [router] is address")
        try:
            router_address = str(ipaddress.IPv4Address(str(raw)))
        except ValueError:
            raise bad(f"[router] address {raw!r} is not an IPv4 address", 'for example address = "192.0.2.1"') from None
        if ROUTER in hosts_doc:
            raise bad(f"host name {ROUTER!r} is the static router's", "name the host otherwise")
    else:
        router = router_doc
    if router not in ROUTERS:
        raise bad(f"router {router!r} is not one podmigrate has", f"choose one of: {', '.join(ROUTERS)}")
    if router == "static" and router_address is None:
        raise bad("router static names no router", 'add a [router] table: address = "IP of its agent"')
    registry = doc.get("registry")
    if registry is not None and (not isinstance(registry, str) or "/" in registry or not registry.strip()):
        raise bad(f"registry {registry!r} is not host:port", 'for example registry = "registry.example:5000"')
    network = doc.get("network", "podman")
    if not names.is_name(network):
        raise bad(f"network {network!r} is not a valid network name", "the name `podman network ls` shows")
    if router == "l2" and network == "podman":
        raise bad(
            "router l2 moves addresses on a segment the hosts share, and Podman's default network is private",
            'name that segment\'s Podman network (a macvlan of one subnet on every host): network = "NAME"',
        )
    here = path.resolve().parent
    state = here / str(doc["state"]) if doc.get("state") else here / f"{path.stem}.state"  # relative: to this file
    return Inventory(path, state, tuple(hosts), registry, str(router), str(network), router_address)
