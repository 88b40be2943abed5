"""The fault matrix: each fault point x mode x transport, injected for real, and where the workload ends up.

``podmigrate bench faults``: one workload moves back and forth between node-a and node-b; each cell
runs one migration in a controller process of its own (so the controller itself can be signalled or
killed) that stops at the cell's point (just after that phase succeeded) until the fault is in place:
a SIGKILLed agent (source or target; the lab restarts it after 3 s, as after a crash), a SIGKILLed
controller (the next command, ``recover``, takes over), SIGTERM to the controller, the target's LAN
link cut (back after 3 s), the target's checkpoint disk filled up (freed after 3 s), the registry
SIGKILLed (back after 3 s), the checkpoint's data tampered with at rest (a flipped byte in the
registry's layer blob, or, after the stream was received and committed, the archive on the target
replaced: what a restore must refuse; tampering with the stream itself is refused while it is
received, tried in ``tests/test_security.py``). Then, with every fault gone: on how many nodes the
workload runs, whether its heap SHA-256 and process start time are the ones it had (cold: a fresh
process, as it should), whether the LAN routes its address to where it runs, and what ``gc --dry-run``
finds left behind. Results: ``faults.jsonl`` (one row per cell) and ``faults.json``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from podmigrate import layout
from podmigrate.engine import gc
from podmigrate.engine.controller import recover, store_for
from podmigrate.errors import PodmigrateError
from podmigrate.lab.cluster import Lab
from podmigrate.polling import poll
from podmigrate.workload import manage
from podmigrate.workload.image import ready_lab

COPY = (("stop-copy", "stream"), ("stop-copy", "registry"), ("decoupled", "stream"), ("lazy", "stream"))
BACK_AFTER_S = 3.0  # how long a killed agent or registry, a cut link or a full disk stays so


@dataclass(frozen=True)
class Cell:
    fault: str
    point: str  # the phase after whose success the fault strikes
    mode: str
    transport: str

    @property
    def label(self) -> str:
        return f"{self.fault} after {self.point}, {self.mode}/{self.transport}"


def matrix() -> list[Cell]:
    cells = [
        Cell(f, p, m, t) for f in ("sigterm", "controller-killed") for m, t in COPY for p in ("checkpoint", "restore")
    ]
    cells += [Cell(f, "stop", "cold", "none") for f in ("sigterm", "controller-killed")]
    for fault, point in (("target-agent-killed", "checkpoint"), ("source-agent-killed", "checkpoint"),
                         ("link-cut", "checkpoint"), ("disk-full", "validate")):  # fmt: skip
        cells += [Cell(fault, point, m, t) for m, t in COPY]
    cells += [Cell("registry-down", p, "stop-copy", "registry") for p in ("checkpoint", "push")]
    cells.append(Cell("tampered", "push", "stop-copy", "registry"))
    cells += [Cell("tampered", "transfer", m, "stream") for m in ("stop-copy", "decoupled", "lazy")]
    return cells


# ------------------------------------------------------------------------------ the controller
def child(lab_name: str, workload: str, target: str, mode: str, transport: str, point: str) -> None:
    """A controller that pauses after ``point`` until its parent answers on stdin, then goes on."""
    from podmigrate.engine.controller import Plan, migrate

    def report(msg: str) -> None:
        if msg.startswith(f"✓ {point} "):
            print("PAUSED", flush=True)
            sys.stdin.readline()

    try:
        rec = migrate(Lab(lab_name), Plan(workload=workload, target=target, mode=mode, transport=transport), report)
        print("RESULT", json.dumps({"status": rec["status"], "id": rec["id"]}), flush=True)
    except PodmigrateError as e:
        failed: dict[str, Any] = e.details.get("record") or {}
        out = {"status": failed.get("status", "refused"), "id": failed.get("id"), "error": e.message}
        print("RESULT", json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ the faults
class Faults:
    """Injects a cell's fault on ``target``/``source`` and takes every trace of it away after."""

    def __init__(self, lab: Lab, cell: Cell, source: str, target: str):
        self.lab, self.cell, self.source, self.target = lab, cell, source, target
        self.timers: list[threading.Timer] = []
        self.mounted = False

    def later(self, action: Callable[[], object]) -> None:
        t = threading.Timer(BACK_AFTER_S, action)
        t.start()
        self.timers.append(t)

    def prepare(self) -> None:
        if self.cell.fault == "disk-full":  # a small disk of its own, so that filling it harms nothing else
            self.lab.run(self.target, ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", layout.NODE_CHECKPOINTS])
            self.mounted = True

    def kill_held(self, name: str) -> None:
        """SIGKILL a supervised lab process and let the lab restart it BACK_AFTER_S later."""
        hold = self.lab.dir / "hold" / name
        hold.touch()
        self.lab.kill_service(name, signal.SIGKILL)
        self.later(lambda: hold.unlink(missing_ok=True))

    def inject(self, proc: subprocess.Popen[str]) -> None:
        f = self.cell.fault
        if f == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif f == "controller-killed":
            proc.send_signal(signal.SIGKILL)
        elif f in ("target-agent-killed", "source-agent-killed"):
            self.kill_held(self.target if f.startswith("target") else self.source)
        elif f == "registry-down":
            self.kill_held("registry")
        elif f == "link-cut":
            self.lab.run("lan", ["ip", "link", "set", f"v{self.target}", "down"])
            self.later(lambda: self.lab.run("lan", ["ip", "link", "set", f"v{self.target}", "up"]))
        elif f == "disk-full":
            filler = f"{layout.NODE_CHECKPOINTS}/filler"
            self.lab.run(self.target, ["fallocate", "-l", "510M", filler])
            self.later(lambda: self.lab.run(self.target, ["rm", "-f", filler]))
        elif f == "tampered":
            self.tamper()

    def tamper(self) -> None:
        if self.cell.transport == "registry":  # the newest big blob is the checkpoint's layer
            blob = max((p for p in (self.lab.dir / "registry").rglob("data") if p.stat().st_size > 4 << 20),
                       key=lambda p: p.stat().st_mtime)  # fmt: skip
            with open(blob, "r+b") as fh:
                fh.seek(4096)
                byte = fh.read(1)
                fh.seek(4096)
                fh.write(bytes([byte[0] ^ 0xFF]))
            return
        agent = self.lab.agent(self.target)
        try:
            files = [x["file"] for x in agent.get("/v1/checkpoints") if x["file"].endswith(".tar")]
        finally:
            agent.close()
        for name in files:
            (self.lab.dir / "nodes" / self.target / "checkpoints" / name).write_bytes(b"not a checkpoint archive")

    def settle(self) -> None:
        """Every fault undone (timers fired now), and the lab's processes answering again."""
        for t in self.timers:
            t.join()
        for name in (self.source, self.target, "registry"):
            (self.lab.dir / "hold" / name).unlink(missing_ok=True)
        poll(self.answering, 60, "the lab's agents and registry to answer after a fault", step=0.2)

    def answering(self) -> bool:
        try:
            for node in (self.source, self.target):
                agent = self.lab.agent(node)
                try:
                    agent.get("/v1/info")
                finally:
                    agent.close()
            return bool(manage.lan_get(self.lab, f"http://{layout.REGISTRY}/v2/", timeout=2)["ok"])
        except PodmigrateError:
            return False

    def unmount(self) -> None:
        if self.mounted:
            self.lab.run(self.target, ["umount", "-l", layout.NODE_CHECKPOINTS])


# ------------------------------------------------------------------------------ one cell
def run_cell(lab: Lab, cell: Cell, name: str, source: str, before: dict[str, Any]) -> dict[str, Any]:
    target = "node-b" if source == "node-a" else "node-a"
    faults = Faults(lab, cell, source, target)
    row: dict[str, Any] = {**asdict(cell), "source": source, "target": target, "started": time.time()}
    faults.prepare()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "podmigrate.bench.faults", lab.name, name, target, cell.mode, cell.transport,
             cell.point],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        result: dict[str, Any] = {}
        for line in proc.stdout:
            if line.startswith("PAUSED"):
                faults.inject(proc)
                row["injected"] = True
                with contextlib.suppress(BrokenPipeError, OSError):
                    proc.stdin.write("\n")
                    proc.stdin.flush()
            elif line.startswith("RESULT "):
                result = json.loads(line.removeprefix("RESULT "))
        row["controller_exit"] = proc.wait()
        faults.settle()
        if not result:  # the controller died: the next command finds its record and finishes it
            done = recover(lab, store_for(lab))
            result = {"status": done[0]["status"] if done else "no record", "recovered": True,
                      "id": done[0]["id"] if done else None}  # fmt: skip
        rec = store_for(lab).get(result["id"]) if result.get("id") else None
        row.update(outcome=result["status"], recovered=result.get("recovered", False),
                   error=(rec or {}).get("error", {}).get("message") or result.get("error"))  # fmt: skip
        row.update(observe(lab, name, cell, before))
    finally:
        for t in faults.timers:
            t.join()
        faults.unmount()
    row["seconds"] = round(time.time() - row["started"], 2)
    return row


def observe(lab: Lab, name: str, cell: Cell, before: dict[str, Any]) -> dict[str, Any]:
    """Where the workload runs, with what state, routed where, and what is left behind."""
    inv = manage.inventory(lab)
    running = [n for n, cs in inv.items() for c in cs if c["name"] == name and c["state"] == "running"]
    out: dict[str, Any] = {"running_on": running, "leftovers": gc.collect(lab, dry_run=True)}
    if len(running) == 1:
        try:
            now = manage.state(lab, name)
        except PodmigrateError as e:
            out.update(serving=False, state_error=e.message)
            return out
        same = now["sha256"] == before["sha256"] and now.get("started") == before.get("started")
        lan = lab.agent("lan")
        try:
            via = lan.get(f"/v1/routes/{now['ip']}")["via"]
        finally:
            lan.close()
        out.update(serving=True, node=running[0], routed=via == layout.node_ip(running[0]),
                   state_kept=None if cell.mode == "cold" else same, fresh_process=not same)  # fmt: skip
    else:
        out["serving"] = False
    return out


def verdict(row: dict[str, Any]) -> str:
    """ok, or what went wrong: lost (not serving, or a stateful move that lost state), twice, leftovers."""
    bad = []
    if not row.get("serving") or row.get("state_kept") is False:
        bad.append("lost")
    if len(row.get("running_on", [])) > 1:
        bad.append("twice")
    if row.get("serving") and not row.get("routed"):
        bad.append("misrouted")
    if any(row.get("leftovers", {}).values()):
        bad.append("leftovers")
    return ", ".join(bad) or "ok"


# ------------------------------------------------------------------------------ the matrix
def run(
    lab: Lab,
    out_dir: Path,
    heap_mb: int = 16,
    only: list[str] | None = None,
    report: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    ready_lab(lab, nodes=2, report=report)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = [c for c in matrix() if not only or c.fault in only]
    name = "faults"
    with contextlib.suppress(PodmigrateError):  # one left by an earlier run
        manage.stop(lab, name)
    manage.start(lab, name, "node-a", heap_mb)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for i, cell in enumerate(cells, 1):
        before = manage.state(lab, name)
        row = run_cell(lab, cell, name, before["node"], before)
        row["verdict"] = verdict(row)
        rows.append(row)
        with open(out_dir / "faults.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        report(f"{i}/{len(cells)} {cell.label}: {row['outcome']}, {row['verdict']}")
        if row["verdict"] != "ok":  # the next cell starts from a clean lab with one serving copy
            gc.collect(lab)
            if not row.get("serving") or len(row["running_on"]) > 1:
                with contextlib.suppress(PodmigrateError):
                    manage.stop(lab, name)
                manage.start(lab, name, "node-a", heap_mb)
    manage.stop(lab, name)
    result = {
        "cells": len(rows),
        "heap_mb": heap_mb,
        "seconds": round(time.time() - t0, 1),
        "ok": sum(1 for r in rows if r["verdict"] == "ok"),
        "lost": sum(1 for r in rows if "lost" in r["verdict"]),
        "twice": sum(1 for r in rows if "twice" in r["verdict"]),
        "leftovers": sum(1 for r in rows if "leftovers" in r["verdict"]),
        "outcomes": {o: sum(1 for r in rows if r["outcome"] == o) for o in sorted({r["outcome"] for r in rows})},
        "rows": rows,
    }
    (out_dir / "faults.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    child(*sys.argv[1:7])
