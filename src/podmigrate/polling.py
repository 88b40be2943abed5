"""Waiting for a condition by polling it with a deadline (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from podmigrate.errors import PodmigrateError

T = TypeVar("T")


def poll(fn: Callable[[], T | None], timeout: float, what: str, step: float = 0.1) -> T:
    """``fn()``'s first truthy value; PodmigrateError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(step)
    raise PodmigrateError(f"timed out after {timeout:.0f} s waiting for {what}")
