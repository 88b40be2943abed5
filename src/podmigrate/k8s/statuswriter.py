"""A migration's status writes while its pod serves no one, made off the blackout's path.

Between the freeze (or the isolation) and the cutover every phase boundary wrote the resource's
status twice and read it once to see whether it was deleted: on this lab 20-35 ms per call to the
API server, six of them inside a 0.4-0.6 s blackout. There the writes go to a thread instead, in
order, one in flight at a time and later ones merged into the next (each carries the whole record,
so the last one says all); whether the resource is being deleted is read from each write's answer
(a status patch returns the object). A crash inside the window resumes from the last write that
landed, as a crash just before that write would have with synchronous writes: the record never
claims a phase done before it was. Outside the window every write is synchronous again, after the
thread's last one.
"""

from __future__ import annotations

import threading
from typing import Any

from podmigrate.k8s import api as k


class StatusWriter:
    def __init__(self, api: k.KubeAPI, path: str):
        self.api, self.path = api, path
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending: dict[str, Any] | None = None
        self.error: str | None = None  # the last background write that failed, for the next flush
        self.deleting = False  # the last answer had a deletionTimestamp, or the resource was gone

    def put(self, status: dict[str, Any]) -> None:
        """Write ``status`` (a merge patch's ``status``) soon, after every write put before it."""
        with self._lock:
            # top-level fields: a later value replaces an earlier one, as two merge patches in a row do
            self._pending = {**(self._pending or {}), **status}
            if not self._idle.is_set():
                return  # the running thread takes it next
            self._idle.clear()
        threading.Thread(target=self._drain, name="status-writer", daemon=True).start()

    def flush(self, timeout: float = 30.0) -> str | None:
        """Wait until every write put has landed; the last background failure, if any (then cleared)."""
        if not self._idle.wait(timeout):
            return f"status writes still in flight after {timeout:.0f} s"
        error, self.error = self.error, None
        return error

    def _drain(self) -> None:
        while True:
            with self._lock:
                body, self._pending = self._pending, None
                if body is None:
                    self._idle.set()
                    return
            try:
                got = self.api.patch(self.path, {"status": body})
                self.deleting = self.deleting or bool((got.get("metadata") or {}).get("deletionTimestamp"))
            except k.KubeError as e:
                self.deleting = self.deleting or e.status == 404
                self.error = e.message
            except Exception as e:  # the thread must end idle whatever a write raised
                self.error = f"{type(e).__name__}: {e}"
