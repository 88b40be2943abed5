"""Ctrl-C and SIGTERM during a migration: roll back at once; a second one leaves the rollback to ``gc``.

The first SIGINT or SIGTERM while phases run raises ``Interrupted`` where the controller is: the
runner treats it as that phase's failure, so before the commit it rolls back (source thawed and
unlocked, prober stopped, copies deleted, record saved after every undo). Past the commit it does not
interrupt: the target then holds the workload (a lazy copy is the only one: its source serves it
pages, nothing to go back to), and a phase cut short there could only leave it unrouted, so the run
finishes. Nor does a signal during a rollback (an undo cut short protects nothing). In both cases it
says what is going on; a second one raises ``Abandoned``, which the controller turns into an error that
says what is left and that ``podmigrate gc`` (or the next migration) finishes the run or the rollback
from its saved record. Only the main thread can take signals; elsewhere this does nothing.
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
def interruptible(
    rec: dict[str, Any] | Any, report: Callable[[str], None], committed: Callable[[], bool] = lambda: False
) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    warned = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal warned
        name = signal.Signals(signum).name
        rolling_back = rec.get("status") == "rolling_back"
        if not rolling_back and not committed():
            raise Interrupted(
                f"interrupted by {name}",
                hint="rolled back: the workload serves where it was; run the migration again when ready",
            )
        if not warned:
            warned = True
            doing = "rolling back" if rolling_back else "finishing (past its commit: the target holds it)"
            report(f"{name}: {doing} migration {rec.get('id')}; send it again to stop and leave the rest to "
                   "`podmigrate gc`")  # fmt: skip
            return
        raise Abandoned(name)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
