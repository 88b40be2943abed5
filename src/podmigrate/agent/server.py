"""The agents' entry point: picks the role's routes and serves them (standard library only).

Run as ``python3 -m podmigrate.agent.server --role node|lan --name NAME --uds PATH --tcp IP:PORT
--token-file PATH --tls-cert C --tls-key K --tls-ca CA [--node-address NAME=IP ...]``. It listens on a
Unix socket (owner-only: how the host-side controller reaches it across namespaces, with the lab's
token) and on TCP on the node's LAN address, TLS with client certificates only (agent to agent: the
certificate is the identity, no token is accepted there). The routes are ``agent.node`` (over
``Podman``) or ``agent.lan``; auth, limits and errors are ``agent.http``'s. A node agent told no
``--node-address`` is a lab's node (``agent.peers``).
"""

from __future__ import annotations

import argparse
import os
import socketserver
import sys
import threading
from pathlib import Path

from podmigrate.agent import tls
from podmigrate.agent.http import App, UnixHTTPServer, make_handler
from podmigrate.agent.lan import LanAgent
from podmigrate.agent.node import NodeAgent
from podmigrate.agent.peers import Peers
from podmigrate.runtime.podman import Podman

__all__ = ["App", "main", "make_handler", "serve"]


def serve(args: argparse.Namespace) -> None:
    token = Path(args.token_file).read_text().strip() if args.token_file else ""
    files = tls.Files(args.tls_cert, args.tls_key, args.tls_ca)
    controllers = frozenset(args.controller or ())
    app = App(args.name, args.role, token, peers=frozenset(args.peer) if args.peer else None, controllers=controllers)
    if args.role == "node":
        NodeAgent(app, Podman(args.name), files, peers=Peers.parse(args.name, args.node_address or [])).register()
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
        servers.append(tls.TLSHTTPServer((host, int(port)), handler, files.server()))
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
    ap.add_argument("--token-file", help="the Unix socket's bearer token (needed with --uds)")
    ap.add_argument("--tls-cert", required=True, help="this agent's certificate (of the lab's CA)")
    ap.add_argument("--tls-key", required=True)
    ap.add_argument("--tls-ca", required=True, help="the CA every TCP peer's certificate must chain to")
    ap.add_argument("--peer", action="append", help="a certificate name let in over TCP (repeat; default: any)")
    ap.add_argument("--controller", action="append", help="a certificate name that may call every route over TCP")
    ap.add_argument("--router-file", help="lan: where the lab's router choice is kept")
    ap.add_argument("--node-address", action="append", metavar="NAME=IP",
                    help="node: its own and each peer's address (repeat; default: the lab's address plan)")  # fmt: skip
    args = ap.parse_args(argv)
    if not (args.uds or args.tcp):
        sys.exit("give --uds and/or --tcp")
    if args.uds and not args.token_file:
        sys.exit("--uds needs --token-file: the token a caller on the socket must show")
    serve(args)


if __name__ == "__main__":
    main()
