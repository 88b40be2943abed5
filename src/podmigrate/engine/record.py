"""Migration records and their store.

A record is a JSON object, written after every step, so that a controller that dies mid-migration
leaves enough behind for the next command to roll it back. Fields:

- ``id``: ``YYYYmmdd-HHMMSS-xxxxxx``; also the checkpoint's file name and registry tag.
- ``workload``, ``container``: what moves (the container name on both nodes; the pod's name when
  ``scope`` is ``pod``, with ``pod``: ``{name, infra, members, mac}``).
- ``source``, ``target``: node names. ``mode``: ``stop-copy`` | ``decoupled`` | ``lazy`` | ``cold``.
  ``transport``: ``registry`` | ``stream`` | ``archive`` (``none`` for cold).
- ``status``: ``running`` -> ``completed`` | ``rolled_back`` | ``failed`` (a rollback failed, or a lazy
  migration failed after its copy ran: then nothing is rolled back).
- ``phase``: the phase running or last run. ``phases``: list of ``{name, started, ended, ok, info}``
  with epoch seconds; ``rollbacks``: what was undone, in order.
- ``controller_pid``: the process running it (a dead pid with status running means: recover).
- ``error``: ``{kind, message, hint, details}`` of the failure, if any.
- results: ``blackout_s`` (and ``blackout_cutover_s``), ``blackout``, ``drift``, ``state``
  (kept/lost), ``bytes`` and ``bytes_moved``, ``criu``, ``state_before``, ``state_after``, ``checks``,
  ``service_addresses``, ``leftovers`` (copies a failed undo could not delete; see ``gc``),
  ``warnings`` (e.g. pod members that start fresh with ``Plan.only``).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

Record = dict[str, Any]


class Store:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS migrations (id TEXT PRIMARY KEY, workload TEXT, "
                "status TEXT, phase TEXT, created REAL, updated REAL, record TEXT)"
            )

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def save(self, rec: Record) -> None:
        rec["updated"] = time.time()
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO migrations VALUES (?,?,?,?,?,?,?)",
                (
                    rec["id"],
                    rec["workload"],
                    rec["status"],
                    rec.get("phase"),
                    rec["created"],
                    rec["updated"],
                    json.dumps(rec, default=str),
                ),
            )

    def get(self, mid: str) -> Record | None:
        with self._db() as db:
            row = db.execute("SELECT record FROM migrations WHERE id=?", (mid,)).fetchone()
        return json.loads(row[0]) if row else None

    def list(self, status: str | None = None, limit: int = 100) -> list[Record]:
        q = "SELECT record FROM migrations"
        args: tuple[Any, ...] = ()
        if status:
            q += " WHERE status=?"
            args = (status,)
        q += " ORDER BY created DESC LIMIT ?"
        with self._db() as db:
            rows = db.execute(q, (*args, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]
