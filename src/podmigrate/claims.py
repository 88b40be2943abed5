"""Which workloads a migration holds right now: one atomic claim per workload, across processes.

A migration claims its workload before anything else (``take``: one SQLite transaction that checks
and writes, so two ``podmigrate migrate`` of one workload cannot both pass) and releases it when it
ends, however it ends. A claim whose process is gone (by its pid and start time: a pid alone may
have been reused) counts as free. ``workload stop``, ``gc`` and ``lab down`` ask ``busy`` first and
refuse while a migration of what they would touch runs, because they would delete its rollback copy
or its record. Standard library only.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from podmigrate import procs
from podmigrate.errors import UsageError


def _alive(pid: int, start: int | None) -> bool:
    """The claiming process still runs: its pid and start time (a pid alone may have been reused)."""
    return start is not None and procs.alive(procs.Proc(pid, start))


class Claims:
    def __init__(self, lab_dir: Path):
        self.path = lab_dir / "claims.db"

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)  # transactions are explicit
        db.execute(
            "CREATE TABLE IF NOT EXISTS claims (workload TEXT PRIMARY KEY, id TEXT, pid INT, at REAL, start INT)"
        )
        if "start" not in {row[1] for row in db.execute("PRAGMA table_info(claims)")}:  # a lab from before
            db.execute("ALTER TABLE claims ADD COLUMN start INT")
        return db

    def take(self, workload: str, mid: str) -> None:
        """Claim ``workload`` for migration ``mid``; UsageError naming the holder if a live one has it."""
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")  # the write lock first: check and claim are one step
            row = db.execute("SELECT id, pid, start FROM claims WHERE workload=?", (workload,)).fetchone()
            if row and row[0] != mid and _alive(int(row[1]), row[2]):
                db.execute("ROLLBACK")
                raise UsageError(
                    f"{workload!r} is already being migrated ({row[0]}, pid {row[1]})",
                    hint="wait for it to finish (podmigrate history shows it)",
                )
            me = procs.identify(os.getpid())
            start = me.start if me else None
            db.execute(
                "INSERT OR REPLACE INTO claims VALUES (?,?,?,?,?)", (workload, mid, os.getpid(), time.time(), start)
            )
            db.execute("COMMIT")
        finally:
            db.close()

    def release(self, workload: str, mid: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM claims WHERE workload=? AND id=?", (workload, mid))

    def busy(self) -> dict[str, tuple[str, int]]:
        """Workload -> (migration id, pid) for the claims whose process still runs."""
        if not self.path.exists():  # no migration ever ran here (and asking must not create the file)
            return {}
        with self._db() as db:
            rows = db.execute("SELECT workload, id, pid, start FROM claims").fetchall()
        return {w: (m, int(p)) for w, m, p, st in rows if _alive(int(p), st)}

    def refuse_if_busy(self, what: str, workloads: set[str] | None = None) -> None:
        """UsageError when a live migration holds one of ``workloads`` (any, for None)."""
        held = {w: h for w, h in self.busy().items() if workloads is None or w in workloads}
        if held:
            names = ", ".join(f"{w} ({m}, pid {p})" for w, (m, p) in sorted(held.items()))
            raise UsageError(
                f"cannot {what} while a migration runs: {names}",
                hint="wait for it to finish, or stop it with Ctrl-C / kill -TERM PID (it rolls back)",
            )
