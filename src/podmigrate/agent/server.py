"""The agents' entry point: picks the role's routes and serves them (standard library only).

Run as ``python3 -m podmigrate.agent.server --role node|lan --name NAME --uds PATH --tcp IP:PORT
--token-file PATH``. It listens on a Unix socket (how the host-side controller reaches it across
namespaces) and on TCP on the node's LAN address (agent to agent, and the DaemonSet's port). The
routes are ``agent.node`` (over ``Podman``) or ``agent.lan``; auth and errors are ``agent.http``'s.
"""

from __future__ import annotations

import argparse
import os
import socket
import socketserver
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from podmigrate.agent.http import App, UnixHTTPServer, make_handler
from podmigrate.agent.lan import LanAgent
from podmigrate.agent.node import NodeAgent
from podmigrate.runtime.podman import Podman

__all__ = ["App", "main", "make_handler", "serve"]


def serve(args: argparse.Namespace) -> None:
    token = Path(args.token_file).read_text().strip()
    app = App(args.name, args.role, token)
    if args.role == "node":
        NodeAgent(app, Podman(args.name)).register()
    else:
        LanAgent(app, args.router_file).register()
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
