"""Memory a target node backs before a restore arrives, and frees as it does (standard library only).

The node agent's reserve-memory and release-memory routes (``agent.node`` registers them and
releases a reservation when a checkpoint's bytes start to arrive; ``agent.node_lazy`` too).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

from podmigrate.agent.http import App, safe_id
from podmigrate.errors import UsageError


def _cgroup_room(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """What this process's own memory limit leaves (an agent pod's ``limits.memory``): a reservation
    over it would have the agent killed. No limit (or no memory controller): no bound from here."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return 1 << 62
    if limit == "max":
        return 1 << 62
    return max(0, int(limit) - used - (64 << 20))  # headroom for the agent itself


class Reservations:
    """Memory made ready for an incoming restore, by checkpoint id.

    On a VM, the first touch of guest memory the hypervisor has not backed yet (or took back: free
    page reporting) costs seconds per GB, and a restore writes a whole heap into fresh pages. Touching
    that much memory before the source freezes, and freeing it as the checkpoint's bytes start to
    arrive (page server, pull, upload) lets their page cache, and then the restore (auto-dedup
    recycles that cache), reuse backed pages."""

    def __init__(self) -> None:
        self._held: dict[str, mmap.mmap] = {}
        self._guard = threading.Lock()

    def release(self, cid: str) -> bool:
        with self._guard:
            m = self._held.pop(cid, None)
        if m is not None:
            m.close()
        return m is not None

    def register(self, app: App) -> None:
        app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/reserve-memory")(self.reserve_memory)
        app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/release-memory")(self.release_memory)

    def reserve_memory(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        cid, n = safe_id(p["cid"]), int(b["bytes"])
        cap = min(os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE // 2, _cgroup_room())
        t0 = time.time()
        self.release(cid)
        with self._guard:  # all reservations together: many migrations at once must not take the node's RAM
            held = sum(len(m) for m in self._held.values())
        if n <= 0 or held + n > cap:
            raise UsageError(
                f"will not reserve {n} bytes: {held} are reserved for other migrations, and all together may "
                f"take at most half of this machine's memory and what the agent's own memory limit leaves ({cap})",
                hint="the target is busy with other migrations: wait for them, or pick another node",
            )
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m[:: mmap.PAGESIZE] = bytes(-(-n // mmap.PAGESIZE))  # one write per page backs it
        with self._guard:
            self._held[cid] = m
        # never held for long: a controller that died must not pin the memory
        threading.Timer(float(b.get("hold_s", 120)), self.release, args=(cid,)).start()
        return {"bytes": n, "seconds": round(time.time() - t0, 3)}

    def release_memory(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"released": self.release(safe_id(p["cid"]))}
