"""CRIU's side of the Podman backend: each run's own CRIU options, and reading what CRIU leaves.

Neighbours: ``podman_cli`` explains podman's failures with ``criu_log_tail``; ``podman_containers``,
``podman_pod`` and ``lazy`` set options with ``criu_options`` and read ``--print-stats`` with
``parse_stats``. Standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from podmigrate.errors import UsageError

CRIU_CONF = Path("/etc/criu/runc.conf")
CRIU_RUNS = Path("/run/podmigrate/criu")  # the runs' own configuration files
RUN_ENV = "PODMIGRATE_CRIU_CONF"  # names a run's own file to podmigrate's criu (``runtime.speculative``)
# podman only names CRIU's log in its error message; the log holds the cause
CRIU_LOG = re.compile(r"(/\S+/userdata/(?:dump|restore)\.log)")
# conmon runs runc's restores with containers.conf's environment only; podman's own runs (its CRIU
# check, runc's checkpoints) with podman's
_CONMON_ENV = '[engine]\nconmon_env_vars = ["{env}={path}", {{append=true}}]\n'

# runc hands CRIU /etc/criu/runc.conf as the request's configuration file, which CRIU reads after
# the request's own fields (runc's: lazy pages, page server, work directory) and lets win: that is
# how podman's ordinary checkpoint/restore become page-server or lazy-pages ones. A run's options
# are therefore the node's runc.conf plus its own lines, in a file of its own that podmigrate's
# criu binds over runc.conf for that CRIU alone (``CriuRun``; a restore finds it through conmon's
# environment, a checkpoint by its container's ID): migrations on one node run their CRIU at once
# and never see each other's options. (``CRIU_CONFIG_FILE`` would not do: CRIU reads it
# before the request, whose fields win.) Where the criu first in the PATH is not podmigrate's
# (``per_run``), the options go into the node's runc.conf itself, and every CRIU run takes turns.
_lock = threading.RLock()


class CriuRun:
    """One podman command's CRIU configuration: the node's runc.conf with ``lines`` added, in a file
    of its own (0600: TLS options name key files). ``env`` is the command's environment; the file
    may be written (``write``) until the command's CRIU starts (a gate's restore: at the release)."""

    def __init__(self, token: str | None = None, runs: Path | None = None):
        runs = runs or CRIU_RUNS
        runs.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = runs / f"{token or secrets.token_hex(8)}.conf"
        self.override = runs / f"{self.path.stem}.containers.conf"
        self.write(())
        _private(self.override, _CONMON_ENV.format(env=RUN_ENV, path=self.path))
        self.env = {**os.environ, RUN_ENV: str(self.path), "CONTAINERS_CONF_OVERRIDE": str(self.override)}

    def write(self, lines: Iterable[str]) -> None:
        # in place: a watch on the file (``runtime.freezer``) stays on it
        _private(self.path, (_node_default() or "") + "".join(f"{line}\n" for line in _one_line_each(lines)))

    def remove(self) -> None:
        for f in (self.path, self.override):
            f.unlink(missing_ok=True)


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _one_line_each(lines: Iterable[str]) -> list[str]:
    out = list(lines)
    for line in out:  # one option per line: a line break would smuggle in another
        if "\n" in line or "\r" in line:
            raise UsageError(f"a CRIU option must be one line: {line!r}")
    return out


def _node_default() -> str | None:
    """The node's runc.conf as podmigrate found it (the lab keeps a copy beside it; None: none)."""
    for f in (CRIU_CONF.with_name("runc.conf.default"), CRIU_CONF):
        with contextlib.suppress(FileNotFoundError):
            return f.read_text()
    return None


@functools.cache
def per_run() -> bool:
    """Whether the criu runc finds first in the PATH binds a run's own file over runc.conf
    (podmigrate's, ``runtime.speculative``); asked once per process."""
    found = shutil.which("criu")
    try:
        with open(found or "", "rb") as f:
            return RUN_ENV.encode() in f.read(65536)
    except OSError:
        return False


def forget_runs(runs: Path | None = None) -> int:
    """Remove every run's files (a node agent starting: the runs of the one before are over)."""
    runs, gone = runs or CRIU_RUNS, 0
    for f in runs.glob("*") if runs.is_dir() else ():
        f.unlink(missing_ok=True)
        gone += 1
    return gone


_block = threading.local()  # the CriuRun of the criu_options block this thread is in


def _for_container(container_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9]", "", container_id)
    if not safe:
        raise UsageError(f"not a container ID: {container_id!r}")
    return f"id-{safe}"


@contextmanager
def criu_options(*lines: str, run: CriuRun | None = None, container_id: str | None = None) -> Iterator[Path]:
    """Run the block's podman commands (``block_env``) with ``lines`` added to CRIU's configuration;
    ``run``: the file of a podman started earlier (a gate's), written now; ``container_id``: the
    container a checkpoint dumps (its file is found by the ID: podman gives runc's checkpoints no
    environment of ours). Yields the file that command's CRIU opens as its configuration (what
    ``runtime.freezer`` watches)."""
    lines = tuple(_one_line_each(lines))
    if run is None and not per_run():
        with _lock:
            default = _node_default()
            if lines:
                CRIU_CONF.write_text((default or "") + "".join(f"{line}\n" for line in lines))
            try:
                yield CRIU_CONF
            finally:
                if lines and default is None:
                    CRIU_CONF.unlink(missing_ok=True)
                elif lines:
                    CRIU_CONF.write_text(default or "")
        return
    this = run or CriuRun(_for_container(container_id) if container_id else None)
    this.write(lines)
    before = getattr(_block, "run", None)
    _block.run = this
    try:
        yield this.path
    finally:
        _block.run = before
        if run is None:
            this.remove()


def block_env() -> dict[str, str] | None:
    """The environment of a podman command run inside this thread's ``criu_options`` block (None
    outside one, or where CRIU's options are the node's runc.conf)."""
    run: CriuRun | None = getattr(_block, "run", None)
    return run.env if run else None


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
