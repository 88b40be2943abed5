"""Mutual TLS for the agents' TCP listeners and their calls to each other (standard library only).

Every peer shows a certificate of the lab's CA (``podmigrate.pki``, made by ``lab up``); the
certificate's common name is the peer's identity (``node-a``, ``controller``, ...), so no shared token
travels between nodes. The handshake runs in the connection's own thread, never in the accept loop:
a peer that connects and says nothing cannot stall the listener.
"""

from __future__ import annotations

import socket
import ssl
import sys
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HANDSHAKE_TIMEOUT = 10.0


def criu_tls_wanted(request: dict[str, Any]) -> bool:
    """Whether a request's CRIU connections go under CRIU's TLS: each migration says so in its own
    requests (``"criu_tls": false`` only for a migration run with security off, to measure what on
    costs), so that no setting outside the request can turn it off for anyone else; absent: on."""
    return request.get("criu_tls") is not False


@dataclass(frozen=True)
class Files:
    """Where one party's certificate, key and the CA that signs every peer are."""

    cert: str
    key: str
    ca: str

    def server(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED  # no certificate of the lab's CA, no connection
        ctx.load_verify_locations(self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def criu(self, *, server: bool) -> tuple[str, ...]:
        """CRIU's own TLS (GnuTLS) for its page-server connections, as runc.conf lines. CRIU checks
        the peer's certificate against the address it was given; the listening side was given its
        own address, so it checks only that the client's certificate is the CA's."""
        lines = ("tls", f"tls-cacert={self.ca}", f"tls-cert={self.cert}", f"tls-key={self.key}")
        return (*lines, "tls-no-cn-verify") if server else lines

    def client(self) -> ssl.SSLContext:
        # the peer's certificate must name the address we dial (node certificates carry their IP)
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def peer_name(sock: object) -> str | None:
    """The common name of a verified TLS peer; "" for a TLS peer without one (refused, never
    asked for a token instead); None on a plain socket."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    cert = sock.getpeercert()
    for rdn in (cert or {}).get("subject", ()):
        for attr in rdn:
            if attr[0] == "commonName":
                return str(attr[1])
    return ""


class TLSHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server whose connections are TLS; the request handler completes the
    handshake (``agent.http``'s handler does, in its ``setup``)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], ctx: ssl.SSLContext):
        self.ctx = ctx
        super().__init__(address, handler)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a refused handshake is expected from strangers: one line, no traceback
        err = sys.exc_info()[1]
        print(f"connection from {client_address[0]} dropped: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
