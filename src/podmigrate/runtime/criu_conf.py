"""CRIU's side of the Podman backend: the node's ``/etc/criu/runc.conf`` options, and reading what CRIU leaves.

Neighbours: ``podman_cli`` explains podman's failures with ``criu_log_tail``; ``podman_containers``,
``podman_pod`` and ``lazy`` set options with ``criu_options`` and read ``--print-stats`` with
``parse_stats``. Standard library only.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from podmigrate.errors import UsageError

CRIU_CONF = Path("/etc/criu/runc.conf")
# podman only names CRIU's log in its error message; the log holds the cause
CRIU_LOG = re.compile(r"(/\S+/userdata/(?:dump|restore)\.log)")

# runc hands /etc/criu/runc.conf (node-private in the lab) to CRIU after its own options, which is
# how podman's ordinary checkpoint/restore become page-server or lazy-pages ones. Every CRIU run on
# the node takes this lock, with options or without: a dump or restore started while another
# migration's options are in the file would take them (its pages sent to the other's page server),
# and the early freezer (``runtime.freezer``) fires on whichever CRIU opens the file first. Concurrent
# migrations on a node therefore take turns for their CRIU steps, and only for those.
_lock = threading.RLock()


@contextmanager
def criu_options(*lines: str) -> Iterator[None]:
    """Run the block as the node's only CRIU user, with ``lines`` added to its configuration."""
    for line in lines:  # one option per line: a line break would smuggle in another
        if "\n" in line or "\r" in line:
            raise UsageError(f"a CRIU option must be one line: {line!r}")
    if not lines:
        with _lock:
            yield
        return
    with _lock:
        default = CRIU_CONF.with_name("runc.conf.default").read_text()
        CRIU_CONF.write_text(default + "".join(f"{line}\n" for line in lines))
        try:
            yield
        finally:
            CRIU_CONF.write_text(default)


@functools.cache
def has_option(option: str) -> bool:
    """Whether the node's CRIU knows ``option`` (its usage names it), asked once per process."""
    try:
        p = subprocess.run(["criu", "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in p.stdout


def criu_log_tail(text: str, lines: int = 25) -> list[str]:
    """The end of the CRIU log that podman's output ``text`` names, its errors first (empty if none)."""
    m = CRIU_LOG.search(text)
    if not m:
        return []
    try:
        with open(m.group(1), errors="replace") as f:
            content = f.read().splitlines()
    except OSError:
        return []
    # CRIU always logs a harmless RLIMIT_NOFILE error here; the real cause is among the last lines
    errs = [x for x in content if "Error" in x and "RLIMIT_NOFILE" not in x]
    return ([*errs[-8:], "...", *content[-lines:]]) if errs else content[-lines:]


_STAMP = re.compile(rb"^\((\d+\.\d+)\)", re.MULTILINE)


def criu_log_end(log: Path) -> float | None:
    """The last timestamp in a CRIU log: seconds from CRIU's start to its last word (None without
    one). Only the end is read: a dump's log at runc's verbosity runs to megabytes."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            stamps = _STAMP.findall(f.read())
    except OSError:
        return None
    return float(stamps[-1]) if stamps else None


def criu_spans(
    label: str, started: float, opened_at: float | None, log: Path | None, ended: float, criu_s: float | None = None
) -> list[Any]:
    """One CRIU run inside a podman command, as timeline spans [what, from, to] on this node's
    clock: podman and runc until CRIU opened its configuration (``opened_at``, its start), CRIU
    until the last line of its ``log`` (or for ``criu_s``, its own statistics' figure, when podman
    deleted the log), podman after it. Spans not measured are left out."""
    end = criu_log_end(log) if log is not None and opened_at is not None else None
    if opened_at is None:
        return []
    end = end if end is not None else criu_s
    if end is None:
        return [[f"podman, runc: until CRIU {label}", started, opened_at]]
    return [
        [f"podman, runc: until CRIU {label}", started, opened_at],
        [f"CRIU {label}", opened_at, opened_at + end],
        [f"podman: after CRIU {label}", opened_at + end, ended],
    ]


def file_tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def parse_stats(stdout: str) -> dict[str, Any]:
    """The statistics JSON that ``--print-stats`` prints (podman adds nothing else with it)."""
    i = stdout.find("{")
    if i < 0:
        return {}
    try:
        data: dict[str, Any] = json.loads(stdout[i:])
    except json.JSONDecodeError:
        return {}
    ctr = (data.get("container_statistics") or [{}])[0]
    out: dict[str, Any] = dict(ctr.get("criu_statistics") or {})
    for k, v in data.items():
        if k.endswith("_duration"):
            out[k] = v
    for k, v in ctr.items():
        if k.endswith("_duration"):
            out[k] = v
    return out
