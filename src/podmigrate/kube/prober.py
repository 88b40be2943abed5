"""A client outside the cluster, as the study's was: from the lab's LAN, every ``interval`` a new TCP
connection and one ``GET`` with a deadline, through a Service as kube-proxy programs it (a node's
address and the Service's NodePort). Each answer is kept with its wall-clock time, so that what a
client saw can be set beside the migration's record: the blackout (the longest run of failed probes
between two answers) and the state's continuity (the workload's counter never going back, the
process's start time never changing)."""

from __future__ import annotations

import heapq
import json
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

from podmigrate.lab.cluster import Lab
from podmigrate.lab.host import join

# runs in the LAN's namespaces (the lab's python3): standard library only; stops when stdin closes
_SCRIPT = r"""
import json, select, socket, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
host, port, path, interval, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
out_lock = threading.Lock()

def probe(t0, m0):
    out = {"t": t0}
    try:
        with socket.create_connection((host, port), timeout=limit) as s:
            out["port"] = s.getsockname()[1]
            s.sendall(request)
            data = b""
            while True:
                s.settimeout(max(0.001, limit - (time.monotonic() - m0)))
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.") or head.split()[1] != b"200":
            raise ValueError(head[:40])
        out.update(ok=True, **json.loads(body))
    except Exception as e:  # errno tells a refusal, an unreachable address and a reset apart
        out.update(ok=False, error=type(e).__name__, errno=getattr(e, "errno", None))
    out["dt"] = time.monotonic() - m0
    with out_lock:
        print(json.dumps(out), flush=True)

# a hanging probe (a dropped SYN waits out its timeout) must not delay the next: a pool, as the engine's prober
pool = ThreadPoolExecutor(max_workers=int(2 * limit / interval) + 4)
due = time.monotonic()
while not select.select([sys.stdin], [], [], max(0.0, due - time.monotonic()))[0]:
    pool.submit(probe, time.time(), time.monotonic())
    due = max(due + interval, time.monotonic())
pool.shutdown(wait=True)
"""


@dataclass
class Prober:
    """``with Prober(lab, host, port) as p: ...``: probes from the LAN until the block ends; then
    ``p.samples`` (each: ``t``, ``ok``, ``dt`` and the answer's fields, or ``error`` and ``errno``;
    ``port``, the client's, once connected: what finds its entry in a node's conntrack table)."""

    lab: Lab
    host: str
    port: int
    path: str = "/counter"
    interval: float = 0.02  # 50 Hz, the study's rate
    timeout: float = 1.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    _proc: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None

    def __enter__(self) -> Prober:
        argv = ["python3", "-c", _SCRIPT, self.host, str(self.port), self.path, str(self.interval), str(self.timeout)]
        cmd, cgroup = self.lab.command("lan", argv)
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=join(cgroup)
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append(json.loads(line))
            except ValueError:
                continue

    def __exit__(self, *_: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader:
            self._reader.join(timeout=5)

    def answered(self) -> int:
        return sum(1 for s in self.samples if s["ok"])


def blackout(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The longest run of failed probes between two answers, in the order they were sent: from the
    last answer before it to the first after it (seconds), and how many probes failed in it."""
    best: dict[str, Any] = {"seconds": 0.0, "failed": 0, "from": None, "to": None}
    last_ok: dict[str, Any] | None = None
    failed = 0
    for s in sorted(samples, key=lambda s: float(s["t"])):
        if not s["ok"]:
            failed += 1
            continue
        if last_ok is not None and failed:
            gap = s["t"] + s["dt"] - (last_ok["t"] + last_ok["dt"])
            if gap > best["seconds"]:
                best = {"seconds": gap, "failed": failed, "from": last_ok["t"], "to": s["t"]}
        last_ok, failed = s, 0
    return best


def went_back(samples: list[dict[str, Any]], key: str = "counter") -> list[tuple[float, int, int]]:
    """Each answer whose ``key`` was below one the client had already received when it sent this
    probe: (time, highest received by then, then). Probes in flight together are served in any
    order; only an answer that came back before the probe was sent can show the state going back."""
    out: list[tuple[float, int, int]] = []
    top: int | None = None
    received: list[tuple[float, int]] = []  # (when it came back, its value), earliest first
    for s in sorted(samples, key=lambda s: float(s["t"])):
        while received and received[0][0] <= s["t"]:
            _, value = heapq.heappop(received)
            top = value if top is None else max(top, value)
        if not s["ok"] or key not in s:
            continue
        if top is not None and s[key] < top:
            out.append((s["t"], top, s[key]))
        heapq.heappush(received, (float(s["t"]) + float(s.get("dt", 0.0)), int(s[key])))
    return out
