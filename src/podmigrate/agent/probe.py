"""A fixed-rate prober of a service address (runs in the LAN agent; standard library only).

Every ``interval`` a new connection is opened and ``GET path`` sent (or, for ``tcp``, only a connect),
each with its own timeout, from a small thread pool so that a hanging probe never delays the next one.
Each record keeps the scheduled and actual send times, so the prober's own scheduling error on a
loaded machine is measured rather than assumed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def fetch(host: str, port: int, target: str, timeout: float) -> dict[str, Any]:
    """One plain HTTP GET, no redirects followed: ``{"ok", "status", "body", "elapsed"}``, or
    ``{"ok": False, "error"}`` when it got no answer."""
    t0 = time.time()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", target)
        r = conn.getresponse()
        body, status = r.read(1 << 20), r.status
    except (OSError, http.client.HTTPException) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "elapsed": time.time() - t0}
    finally:
        conn.close()
    return {"ok": status == 200, "status": status, "body": body.decode(errors="replace"), "elapsed": time.time() - t0}


class Probe:
    def __init__(
        self,
        host: str,
        port: int,
        path: str | None = "/healthz",
        interval: float = 0.02,
        timeout: float = 1.0,
        max_seconds: float = 1800.0,
    ):
        self.id = uuid.uuid4().hex[:12]
        self.host, self.port, self.path = host, port, path
        self.interval, self.timeout, self.max_seconds = interval, timeout, max_seconds
        self.records: list[dict[str, Any]] = []
        self._inflight: dict[int, dict[str, Any]] = {}  # sent, not answered (or timed out) yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(8, int(2 * timeout / interval) + 4))
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        t0 = time.monotonic()
        wall0 = time.time() - t0
        seq = 0
        while not self._stop.is_set() and time.monotonic() - t0 < self.max_seconds:
            due = t0 + seq * self.interval
            delay = due - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
                if self._stop.is_set():
                    break
            self._pool.submit(self._one, seq, wall0 + due)
            seq += 1

    def _one(self, seq: int, scheduled: float) -> None:
        rec: dict[str, Any] = {"seq": seq, "scheduled": scheduled, "sent": time.time(), "ok": False}
        with self._lock:
            self._inflight[seq] = rec
        try:
            if self.path is None:
                with socket.create_connection((self.host, self.port), timeout=self.timeout):
                    rec["ok"] = True
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                try:
                    conn.request("GET", self.path)
                    resp = conn.getresponse()
                    body = resp.read(4096)
                    rec["status"] = resp.status
                    rec["ok"] = resp.status == 200
                    if rec["ok"]:
                        try:
                            counter = json.loads(body).get("counter")
                            if isinstance(counter, int):
                                rec["counter"] = counter
                        except (ValueError, AttributeError):
                            pass
                finally:
                    conn.close()
        except OSError as e:
            rec["error"] = type(e).__name__
        rec["answered"] = time.time()
        with self._lock:
            if self._inflight.pop(seq, None) is not None:  # else: stopped without waiting, reported pending
                self.records.append(rec)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted(self.records, key=lambda r: r["seq"])

    def stop(self, wait: bool = True) -> list[dict[str, Any]]:
        """Stop probing; the log. ``wait``: let the probes in flight finish (up to ``timeout``);
        else they are in the log as they are, ``"pending": True`` without an answer (the caller
        knows which of them can still matter)."""
        self._stop.set()
        self._thread.join()
        if wait:
            self._pool.shutdown(wait=True)
            return self.snapshot()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = [{**r, "pending": True} for r in self._inflight.values()]
            self._inflight.clear()
        return sorted(self.records + pending, key=lambda r: r["seq"])


class KeepAlive:
    """One client TCP connection held open and polled (HTTP/1.1 keep-alive), never reconnected.

    It shows whether an established connection survives a migration: ``same_connection`` stays true
    only if every request went over the socket opened at the start. TCP_USER_TIMEOUT keeps the
    kernel from giving up during a long freeze.
    """

    def __init__(
        self,
        host: str,
        port: int,
        path: str = "/counter",
        interval: float = 0.05,
        user_timeout_ms: int = 300_000,
        max_seconds: float = 1800.0,
    ):
        self.id = uuid.uuid4().hex[:12]
        self.path, self.interval, self.max_seconds = path, interval, max_seconds
        self.conn = http.client.HTTPConnection(host, port, timeout=user_timeout_ms / 1000)
        self.conn.connect()
        assert self.conn.sock is not None
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
        self.local = self.conn.sock.getsockname()
        self.requests, self.max_gap = 0, 0.0
        self.error: str | None = None
        self.first_counter: int | None = None
        self.last_counter: int | None = None
        self.backwards = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        t0 = time.monotonic()
        last = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - t0 < self.max_seconds:
            try:
                self.conn.request("GET", self.path)
                data = json.loads(self.conn.getresponse().read())
            except (OSError, ValueError, http.client.HTTPException) as e:
                self.error = f"{type(e).__name__}: {e}"
                return
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            self.requests += 1
            c = data.get("counter")
            if isinstance(c, int):
                if self.last_counter is not None and c < self.last_counter:
                    self.backwards = True
                self.first_counter = c if self.first_counter is None else self.first_counter
                self.last_counter = c
            self._stop.wait(self.interval)

    def status(self) -> dict[str, Any]:
        sock = self.conn.sock
        same = self.error is None and sock is not None and sock.getsockname() == self.local
        return {
            "id": self.id,
            "local": list(self.local),
            "requests": self.requests,
            "max_gap_s": round(self.max_gap, 4),
            "first_counter": self.first_counter,
            "last_counter": self.last_counter,
            "counter_went_backwards": self.backwards,
            "error": self.error,
            "same_connection": same,
            "alive": self._thread.is_alive(),
        }

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=self.interval + 2)  # a live connection answers and the loop ends
        st = self.status()
        if self._thread.is_alive() and self.conn.sock is not None:
            # stuck reading from a peer that went away without a FIN (a retired source is cut off so):
            # shut the socket down to wake the read, or close() would wait on the reader's lock for the
            # whole TCP_USER_TIMEOUT (300 s; the cause of a test that took 311 s)
            with contextlib.suppress(OSError):
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            self._thread.join(timeout=10)
        self.conn.close()
        return st
