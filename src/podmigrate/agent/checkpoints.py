"""A node's checkpoint directory: file names by checkpoint id and one lock per id (standard library only).

Shared by the node agent's routes (``agent.node``, ``agent.node_lazy``); ids are checked by
``agent.http.safe_id`` before they become file names.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

from podmigrate.agent.http import safe_id

MAX_LOCKS = 256  # per-checkpoint locks kept before the free ones are dropped


class CheckpointDir:
    """Where a checkpoint's archive, page images and lazy-restore work files live on this node."""

    def __init__(self, root: Path):
        self.root = root
        # One lock per checkpoint id: an undo (delete, registry delete) sent by a controller that gave up,
        # or by a later one recovering, waits for the operation still running on that checkpoint, instead
        # of racing it and letting it leave an image or an archive behind.
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def busy(self, cid: str) -> threading.Lock:
        with self._guard:
            if len(self._locks) > MAX_LOCKS:  # a long run: forget the locks nobody holds
                for k in [k for k, lock in self._locks.items() if not lock.locked()]:
                    del self._locks[k]
            return self._locks.setdefault(safe_id(cid), threading.Lock())

    def archive(self, cid: str) -> Path:
        return self.root / f"{safe_id(cid)}.tar"

    def pages(self, cid: str) -> Path:
        return self.root / f"{safe_id(cid)}.pages"

    def work(self, cid: str) -> Path:
        return self.root / f"{safe_id(cid)}.work"

    def members(self, cid: str, members: list[str]) -> dict[str, Path]:
        """A pod's checkpoint: one archive per member, ``<id>.<member>.tar``."""
        return {m: self.archive(f"{cid}.{safe_id(m)}") for m in members}

    def remove(self, cid: str) -> bool:
        """Delete everything checkpoint ``cid`` left here; True when its archive was present."""
        a = self.archive(cid)
        shutil.rmtree(self.pages(cid), ignore_errors=True)
        shutil.rmtree(self.work(cid), ignore_errors=True)
        (self.root / f"{safe_id(cid)}.tar.full").unlink(missing_ok=True)
        existed = a.exists()
        for f in (
            a,
            a.with_name(a.name + ".part"),
            a.with_name(a.name + ".part.sha256"),
            *self.root.glob(f"{safe_id(cid)}.*.tar*"),
        ):
            f.unlink(missing_ok=True)
        return existed

    def listing(self) -> list[dict[str, Any]]:
        return [
            {"id": f.name.split(".", 1)[0], "file": f.name, "bytes": f.stat().st_size, "mtime": f.stat().st_mtime}
            for f in sorted(self.root.iterdir())
        ]
