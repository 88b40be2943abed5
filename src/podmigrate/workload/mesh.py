"""mesh: a small service of the benchmark's background load (the study's Online Boutique stand-in).

Each instance answers ``GET /work`` (a SHA-256 over 16 KB, a few hundred microseconds of CPU) and
calls its peers' ``/work`` at ``RATE`` requests per second in all, round robin, one short-lived
connection each, as microservices behind a service mesh do. Standard library only (it runs in the
workload image on Debian's python3).

  GET /healthz  -> {"ok": true}
  GET /work     -> {"digest": ...}
  GET /stats    -> {"rate", "peers", "sent", "ok", "failed"}
  GET /rate/50  -> the stats, calling at 50 requests per second from now on (0: idle, still serving)

Environment: LISTEN (0.0.0.0:8000), PEERS (``ip:port,...``), RATE (requests per second, 0).
"""

import hashlib
import json
import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOST, _, PORT = os.environ.get("LISTEN", "0.0.0.0:8000").rpartition(":")
BLOCK = os.urandom(16 << 10)
state: dict[str, Any] = {
    "rate": float(os.environ.get("RATE", "0")),
    "peers": [p for p in os.environ.get("PEERS", "").split(",") if p],
    "sent": 0,
    "ok": 0,
    "failed": 0,
}
lock = threading.Lock()


def caller() -> None:
    i = 0
    while True:
        with lock:
            rate, peers = state["rate"], list(state["peers"])
        if rate <= 0 or not peers:
            time.sleep(0.1)
            continue
        started = time.monotonic()
        peer = peers[i % len(peers)]
        i += 1
        try:
            with urllib.request.urlopen(f"http://{peer}/work", timeout=2) as r:
                r.read()
            outcome = "ok"
        except OSError:
            outcome = "failed"
        with lock:
            state["sent"] += 1
            state[outcome] += 1
        time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - started)))


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def reply(self, body: dict[str, Any]) -> None:
        out = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self.reply({"ok": True})
        elif self.path == "/work":
            self.reply({"digest": hashlib.sha256(BLOCK + str(time.time()).encode()).hexdigest()})
        elif self.path == "/stats" or self.path.startswith("/rate/"):
            with lock:
                if self.path.startswith("/rate/"):
                    state["rate"] = max(0.0, float(self.path.removeprefix("/rate/")))
                self.reply(dict(state))
        else:
            self.send_error(404)


threading.Thread(target=caller, daemon=True).start()
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer((HOST, int(PORT)), Handler).serve_forever()
