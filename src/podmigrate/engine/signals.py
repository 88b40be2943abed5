"""Ctrl-C and SIGTERM during a migration: roll back at once; a second one leaves the rollback to ``gc``.

The first SIGINT or SIGTERM while phases run raises ``Interrupted`` where the controller is: the
runner treats it as that phase's failure, so before the commit it rolls back (source thawed and
unlocked, prober stopped, copies deleted, record saved after every undo) and past the commit it
finishes. A signal during a rollback does not interrupt it (an undo cut short protects nothing): it
says what is going on; a second one raises ``Abandoned``, which the controller turns into an error that
says what is left and that ``podmigrate gc`` (or the next migration) finishes the rollback from its
saved record. Only the main thread can take signals; elsewhere this does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from podmigrate.errors import PodmigrateError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(PodmigrateError):
    """SIGINT or SIGTERM arrived while the migration ran."""


class Abandoned(BaseException):
    """A second signal during a rollback: the caller stops undoing (the record says where)."""


@contextmanager
def interruptible(rec: dict[str, Any] | Any, report: Callable[[str], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    warned = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal warned
        name = signal.Signals(signum).name
        if rec.get("status") != "rolling_back":
            raise Interrupted(
                f"interrupted by {name}",
                hint="rolled back: the workload serves where it was; run the migration again when ready",
            )
        if not warned:
            warned = True
            report(f"{name}: rolling back migration {rec.get('id')}; send it again to stop the rollback "
                   "and leave it to `podmigrate gc`")  # fmt: skip
            return
        raise Abandoned(name)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
