"""The agents' HTTP layer: a route table, bearer-token auth, errors as JSON (standard library only).

Shared by the lab's node and LAN agents (``agent.node``, ``agent.lan``, served by ``agent.server``)
and the Kubernetes node agent (``k8s.agent``). Every request must carry ``Authorization: Bearer
<token>``; errors travel as ``{"error": {...}}`` in the shape of ``podmigrate.errors``.
"""

from __future__ import annotations

import hmac
import json
import re
import socketserver
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from podmigrate.errors import AgentError, PodmigrateError, UsageError

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


def safe_id(value: str) -> str:
    """A checkpoint id or member name, checked before it becomes part of a file name."""
    if not _SAFE_ID.match(value):
        raise UsageError(f"not a valid checkpoint id: {value!r}")
    return value
