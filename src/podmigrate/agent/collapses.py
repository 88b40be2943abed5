"""A restored copy's huge pages, put back after its migration rather than inside it.

Once a lazy restore's last page is in, the copy's memory goes back into huge pages
(``runtime.hugepages``): 0.1 to 1.6 s here for 256 MB to 1 GB, longer when the kernel must compact
memory to find free 2 MB pages. The copy serves without them and the source is already released,
so nobody needs to wait: an evacuation's next migration used to. The collapse runs in a thread of
the target's agent; its outcome is read when wanted (the benchmark waits for it). A checkpoint of
the same container waits for it first, so that no dump reads memory the kernel is moving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

KEEP = 64  # finished outcomes kept for reading, the oldest dropped first
SETTLE_S = 30.0  # how long a checkpoint waits for a collapse of its container


class Collapses:
    """Per container name: at most one collapse running, and the last outcome."""

    def __init__(self, collapse: Callable[[str], dict[str, Any]]):
        self._collapse = collapse
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, Any]] = {}
        self._done: dict[str, threading.Event] = {}

    def start(self, name: str) -> dict[str, Any]:
        """Start collapsing ``name``'s memory (or join the collapse already running)."""
        with self._lock:
            if name in self._done and not self._done[name].is_set():
                return self.status(name)
            self._jobs.pop(name, None)
            self._jobs[name] = {"state": "collapsing", "started": time.time()}
            self._done[name] = done = threading.Event()
            for old in [n for n in self._jobs if self._done[n].is_set()][:-KEEP]:
                del self._jobs[old], self._done[old]
        threading.Thread(target=self._run, args=(name, done), name=f"collapse-{name}", daemon=True).start()
        return self.status(name)

    def _run(self, name: str, done: threading.Event) -> None:
        try:
            res = {**self._collapse(name), "state": "done"}
        except Exception as e:  # recorded, never raised: the copy serves either way
            res = {"state": "failed", "error": f"{type(e).__name__}: {e}"[:300]}
        with self._lock:
            self._jobs[name] = {**res, "started": self._jobs[name]["started"], "ended": time.time()}
            done.set()

    def status(self, name: str) -> dict[str, Any]:
        """``state``: none (never asked here), collapsing, done (with what the kernel did) or failed."""
        return dict(self._jobs.get(name) or {"state": "none"})

    def wait(self, name: str, timeout: float = SETTLE_S) -> dict[str, Any]:
        """The outcome once the collapse of ``name`` has ended, or its status after ``timeout``."""
        done = self._done.get(name)
        if done is not None:
            done.wait(timeout)
        return self.status(name)
