"""The agents' HTTP layer: a route table, authentication, limits, errors as JSON (standard library only).

Shared by the lab's node and LAN agents (``agent.node``, ``agent.lan``, served by ``agent.server``)
and the Kubernetes node agent (``k8s.agent``). A request is authenticated by the TLS client
certificate its connection showed (``agent.tls``: the peer's name) or, on the owner-only Unix socket
and the Kubernetes agent, by ``Authorization: Bearer <token>``. Errors travel as ``{"error": {...}}``
in the shape of ``podmigrate.errors``; an unexpected one says what failed, and its traceback goes to
the agent's log only (a reply may cross the network).
"""

from __future__ import annotations

import hmac
import json
import re
import socketserver
import sys
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from podmigrate import names
from podmigrate.agent import tls
from podmigrate.errors import AgentError, PodmigrateError, UsageError

Handler = Callable[[dict[str, str], dict[str, Any]], Any]
STATUS = {"UsageError": 400, "NotFound": 404, "AgentError": 502, "LabError": 503}
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
MAX_JSON = 1 << 20  # requests are small documents; anything bigger is a mistake or an attack
MAX_UPLOAD = 1 << 40  # a checkpoint stream: bounded by its Content-Length, which must be given


class TooLarge(UsageError):
    pass


class App:
    """A route table: (method, regex) -> handler(params, body)."""

    def __init__(
        self,
        name: str,
        role: str,
        token: str,
        peers: frozenset[str] | None = None,
        peers_call_all: bool = False,
        controllers: frozenset[str] = frozenset(),
    ):
        """``token``: what a request on the Unix socket must carry ("" refuses them all);
        ``peers``: the certificate names let in over TLS (None: any the CA signed);
        ``peers_call_all``: whether they may call every route (the Kubernetes agent, whose peer is
        the operator) or only those registered with ``peer=True`` (a lab node's: what another node
        needs to hand it a checkpoint, nothing that runs, stops or sends anything);
        ``controllers``: certificate names that may call every route over TLS (hosts' controller,
        which has no Unix socket to them)."""
        self.name, self.role, self.token = name, role, token
        self.peers = peers if peers is None or not controllers else peers | controllers
        self.peers_call_all, self.controllers = peers_call_all, controllers
        self.routes: list[tuple[str, re.Pattern[str], Handler, bool]] = []
        self.started = time.time()

    def route(self, method: str, pattern: str, peer: bool = False) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.routes.append((method, re.compile(pattern), fn, peer))
            return fn

        return deco

    def authenticated(self, auth: str | None, peer: str | None) -> bool:
        if peer is not None:  # a TLS connection: its certificate is the identity, tokens do not count
            return bool(peer) and (self.peers is None or peer in self.peers)
        return bool(self.token) and hmac.compare_digest((auth or "").encode(), f"Bearer {self.token}".encode())

    def dispatch(
        self, method: str, path: str, auth: str | None, load: Callable[[], dict[str, Any]], peer: str | None = None
    ) -> tuple[int, Any]:
        """Route one request; ``load`` reads the body (JSON, or a raw stream for uploads) only
        after the caller was authenticated (``peer``: its verified certificate's name)."""
        if not self.authenticated(auth, peer):
            if peer is not None:
                err = AgentError(f"agent {self.name}: certificate {peer!r} is not one of its peers")
            else:
                err = AgentError(f"agent {self.name}: missing or wrong token", hint="use the lab's token file")
            return 401, {"error": err.to_wire()}
        path = path.split("?", 1)[0]
        for m, rx, fn, peer_ok in self.routes:
            match = rx.fullmatch(path)
            if match and m == method:
                if peer is not None and not (peer_ok or self.peers_call_all or peer in self.controllers):
                    err = AgentError(
                        f"agent {self.name}: {method} {path} is not open to peers ({peer!r})",
                        hint="other nodes may only hand over checkpoints; the controller calls the rest",
                    )
                    return 403, {"error": err.to_wire()}
                try:
                    params = match.groupdict()
                    for key, value in params.items():  # names, ids and addresses: one rule for all
                        names.name(value, f"{key} in {method} {path}")
                    return 200, fn(params, load())
                except TooLarge as e:
                    return 413, {"error": e.to_wire()}
                except PodmigrateError as e:
                    e.details.setdefault("node", self.name)
                    return STATUS.get(type(e).__name__, 500), {"error": e.to_wire()}
                except Exception as e:
                    print(f"{method} {path} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                    return 500, {
                        "error": AgentError(
                            f"agent {self.name}: {method} {path} failed ({type(e).__name__})",
                            hint="the agent's log has the details",
                            details={"node": self.name},
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

        def setup(self) -> None:
            super().setup()
            do_handshake = getattr(self.request, "do_handshake", None)
            if do_handshake is not None:  # TLS: in this connection's thread, bounded
                self.request.settimeout(tls.HANDSHAKE_TIMEOUT)
                do_handshake()
                self.request.settimeout(None)

        def _load(self) -> dict[str, Any]:
            if self.headers.get("Transfer-Encoding"):
                raise UsageError("chunked request bodies are not accepted; send a Content-Length")
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise UsageError("Content-Length is not a number") from None
            if self.headers.get("Content-Type") == "application/octet-stream":
                if not 0 <= n <= MAX_UPLOAD:
                    raise TooLarge(f"an upload of {n} bytes is over this agent's limit of {MAX_UPLOAD}")
                return {"stream": self.rfile, "length": n, "headers": dict(self.headers.items())}
            if not 0 <= n <= MAX_JSON:
                raise TooLarge(
                    f"a request body of {n} bytes is over this agent's limit of {MAX_JSON} bytes",
                    hint="requests are small JSON documents; checkpoints travel as application/octet-stream",
                )
            try:
                body = json.loads(self.rfile.read(n)) if n else {}
            except ValueError:
                raise UsageError("the request body is not JSON") from None
            if not isinstance(body, dict):
                raise UsageError("the request body must be a JSON object")
            return body

        def _handle(self) -> None:
            peer = tls.peer_name(self.request)
            status, data = app.dispatch(self.command, self.path, self.headers.get("Authorization"), self._load, peer)
            if status != 200:
                self.close_connection = True  # an unread request body must not be parsed as a request
            out = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            if self.close_connection:  # say so: a keep-alive client must not send into a closing socket
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_DELETE = _handle

    return H


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def safe_id(value: str) -> str:
    """A checkpoint id or member name, checked before it becomes part of a file name."""
    if not _SAFE_ID.fullmatch(value):
        raise UsageError(f"not a valid checkpoint id: {value!r}")
    return value
