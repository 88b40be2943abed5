"""stream-server: a pseudo-random float64 heap of HEAP_MB megabytes and a monotonic counter.

Runs inside the workload container (python3 + numpy). Environment: HEAP_MB (default 64), SEED (1234),
LISTEN (0.0.0.0:8000), TICK_S (0.01: the counter's period). HTTP/1.1 keep-alive:
  GET /healthz -> {"ok": true, "counter"}                         (cheap; what probes use)
  GET /counter -> {"counter", "pid", "heap_mb", "started"}         (cheap)
  GET /state   -> the same plus "sha256" of the heap bytes         (hashes the whole heap)
The heap is generated from the seed, so its digest is known before start and identical after any
correct migration; the counter only grows while the process runs, so a restore from an older
checkpoint or a restart shows as a smaller or reset counter.
"""

import hashlib
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MB = int(os.environ.get("HEAP_MB", "64"))
SEED = int(os.environ.get("SEED", "1234"))
HOST, _, PORT = os.environ.get("LISTEN", "0.0.0.0:8000").rpartition(":")
TICK = float(os.environ.get("TICK_S", "0.01"))
if MB <= 0:
    raise SystemExit(f"HEAP_MB must be a positive number of megabytes, not {MB}")

t0 = time.time()
heap: Any
view: memoryview
try:
    import numpy as np

    heap = np.random.default_rng(SEED).random(MB * (1 << 20) // 8)  # float64
    view = memoryview(heap).cast("B")
    KIND = "numpy-float64"
except ImportError:
    import random

    heap = bytearray(random.Random(SEED).randbytes(MB << 20))
    view = memoryview(heap)
    KIND = "bytes"
GEN_S = round(time.time() - t0, 3)
STARTED = time.time()
counter = 0


def tick() -> None:
    global counter
    while True:
        time.sleep(TICK)
        counter += 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            d: dict[str, object] = {"ok": True, "counter": counter}
        elif path in ("/counter", "/state"):
            d = {
                "counter": counter,
                "pid": os.getpid(),
                "heap_mb": MB,
                "kind": KIND,
                "gen_s": GEN_S,
                "started": STARTED,
                "seed": SEED,
            }
            if path == "/state":
                t = time.time()
                d["sha256"] = hashlib.sha256(view).hexdigest()
                d["hash_s"] = round(time.time() - t, 3)
        else:
            self.send_error(404)
            return
        body = json.dumps(d).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# As PID 1 of its container the server would ignore SIGTERM (no default action for PID 1): exit on it,
# so that `podman stop` does not wait for its timeout.
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
threading.Thread(target=tick, daemon=True).start()
ThreadingHTTPServer.daemon_threads = True
# socketserver listens with a backlog of 5: the clients that queued while a checkpoint froze the
# process (the kubelet's freezes it for seconds) overflowed it once it ran again, and every other new
# connection waited for a SYN retransmit (1 s) for a second or more. 128 is socket.listen()'s own default.
ThreadingHTTPServer.request_queue_size = 128
ThreadingHTTPServer((HOST, int(PORT)), Handler).serve_forever()
