"""The engine benchmark: blackout and phase times for each mode and transport at several heap sizes,
next to Podman's own paths, measured side by side in one run.

Before anything, free guest memory can be touched once (``bench.memory``: first touch of fresh
guest memory is slow on VMs). For each heap size a stream-server is started on node-a and moved
there and back as a warm-up (the warm-up runs are kept in the results, marked). Then every method
runs ``runs`` times, alternating direction. Podman's paths: ``archive`` (``checkpoint --export`` /
copy / ``restore --import``, through the engine), and in ``bench.podman_paths``, as plain podman
commands with the same prober and state checks: ``podman-image`` (``checkpoint --create-image``,
``push``, ``pull``, ``restore IMAGE``, route switch) and the one-node ``checkpoint --export`` /
``restore --import`` that issue 14's ratio is judged against.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from podmigrate.bench import breakdown, memory, podman_paths, suite
from podmigrate.bench import load as background
from podmigrate.engine import paths
from podmigrate.engine.controller import Plan, migrate
from podmigrate.engine.phases import lazy
from podmigrate.errors import UsageError
from podmigrate.lab.cluster import Lab, Report
from podmigrate.workload import manage

# (label, mode, transport, compression); cold last: it throws the state away
METHODS: list[tuple[str, str, str, str]] = [
    ("stop-copy/stream", "stop-copy", "stream", "none"),
    ("stop-copy/registry", "stop-copy", "registry", "none"),
    ("stop-copy/registry+zstd", "stop-copy", "registry", "zstd"),
    ("stop-copy/registry+gzip", "stop-copy", "registry", "gzip"),
    ("decoupled/stream", "decoupled", "stream", "none"),
    ("lazy (post-copy)", "lazy", "stream", "none"),
    ("decoupled/registry", "decoupled", "registry", "none"),
    ("podman archive (export/copy/import)", "stop-copy", "archive", "none"),
    ("podman-image (create-image/push/pull)", "podman-image", "", ""),
    (breakdown.ONE_NODE, "podman-one-node", "", ""),
    ("cold restart", "cold", "none", "none"),
]


class Variant:
    """One of the settings a run alternates between: what it does to the lab before its
    migrations (``apply``: the background load) and what it asks of each of them (``plan``:
    security, old paths, which belong to that one migration and to no other on the lab)."""

    def __init__(self, label: str, apply: Callable[[], object] = lambda: None, **plan: Any):
        self.label, self.apply, self.plan = label, apply, plan


def _row(label: str, heap: int, rec: Mapping[str, Any], warmup: bool = False) -> dict[str, Any]:
    dump = (rec.get("criu") or {}).get("dump") or {}
    return {
        "heap_mb": heap,
        "method": label,
        "warmup": warmup,
        "direction": f"{rec['source']}->{rec['target']}",
        "blackout_s": rec.get("blackout_s"),
        "blackout_cutover_s": rec.get("blackout_cutover_s"),
        "drift_counter": (rec.get("drift") or {}).get("counter"),
        "state": rec.get("state"),
        "phase_s": rec.get("phase_s", {}),
        "criu_frozen_s": round(dump["frozen_time"] / 1e6, 3) if "frozen_time" in dump else None,
        "bytes_moved": rec.get("bytes_moved"),
        # what crossed per second while it moved; for lazy, the pages' tail after the restore
        "throughput_mb_s": rec.get("throughput_mb_s"),
        "archive_bytes": (rec.get("bytes") or {}).get("archive"),
        "pushed_bytes": (rec.get("bytes") or {}).get("pushed"),
        "sha256_equal": (rec.get("checks") or {}).get("sha256_equal"),
        "id": rec.get("id"),
        "blackout_steps": rec.get("blackout_steps"),
        "cutover_failed_probes": ((rec.get("blackout") or {}).get("at_cutover") or {}).get("failed"),
        "prefetch": {
            k: v for k, v in ((rec.get("lazy") or {}).get("prefetch") or {}).items() if k in ("outcome", "bytes")
        },
        "runtime_s": rec.get("runtime_s"),  # Podman's own paths: what runc and CRIU took inside them
        # after a lazily filled restore: how much of the copy's memory went back into huge pages
        "huge_pages": {
            k: v for k, v in (rec.get("huge_pages") or {}).items() if k in ("bytes", "collapsed_bytes", "seconds")
        },
    }


def run(
    lab: Lab,
    heaps: list[int],
    runs: int,
    out_dir: Path,
    report: Report = lambda _m: None,
    methods: list[str] | None = None,
    warm_memory_gib: float | None = 0,  # None: what the runs touch (bench.memory.warm)
    security: tuple[str, ...] = ("on",),  # ("on", "off"): each run of each method with both, interleaved
    old_paths: tuple[str, ...] = (),  # engine.paths changes: each run with the new path and the old, interleaved
    load: tuple[str, ...] = ("off",),  # ("on", "off"): each run with the background load (bench.load) and without
) -> dict[str, Any]:
    lab.require_up()
    if not security or set(security) - {"on", "off"}:
        raise UsageError(f"security settings are on and off, not {list(security)}")
    if not load or set(load) - {"on", "off"}:
        raise UsageError(f"background load settings are on and off, not {list(load)}")
    if sum((len(security) > 1, bool(old_paths), len(load) > 1)) > 1:
        raise UsageError("compare one thing per run: security on/off, old/new paths or load on/off")
    # gzip is single-threaded (~20 MB/s here): only when asked for, as in the sweep
    chosen = [
        m
        for m in METHODS
        if (methods is None and m[3] != "gzip")
        or (methods is not None and (m[0].split()[0] in methods or m[0] in methods))
    ]
    if not chosen:
        raise UsageError(f"no benchmark method matches {methods}", hint=f"methods: {[m[0] for m in METHODS]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "machine.json").write_text(json.dumps(suite.machine(lab), indent=2))
    rows: list[dict[str, Any]] = []
    if warm_memory_gib != 0:
        # the largest heap meets the most fresh memory: its first migrations before the warm-up, set
        # beside the first ones after it (``memory.effect``), say what warming changed in this run
        _fresh_pair(lab, max(heaps), rows, report)
    warmed: dict[str, Any] = {"gib": 0, "seconds": 0.0}
    if warm_memory_gib != 0:
        warmed = memory.warm(warm_memory_gib, memory.need_gib(list(heaps)))
    report(f"guest memory warm-up: touched {warmed['gib']} GiB in {warmed['seconds']} s")
    mesh = background.start(lab, report=report) if "on" in load else None
    alternating = variants(security, old_paths, load, mesh)
    try:
        for index, heap in enumerate(heaps):
            _heap_runs(lab, heap, index, chosen, runs, alternating, rows, out_dir, report)
    finally:
        if mesh:
            mesh.stop()
    tab = table(rows)
    if warm_memory_gib != 0 and (warm_effect := memory.effect(rows, max(heaps))):
        warmed["effect"] = warm_effect
        report(memory.describe(warm_effect))
    notes = [n for n in (breakdown.prefetches(rows), breakdown.huge_pages(rows)) if n]
    for note in notes:
        report(note)
    cost = security_cost(tab) if len(security) > 1 else []
    changed = paired(tab, "new path", f"old path: {','.join(old_paths)}") if old_paths else []
    loaded = paired(tab, "load on", "load off") if len(load) > 1 else []
    targets = [t for v in alternating for t in breakdown.ratios(tab, rows, v.label)]
    summary = {
        "created": time.time(),
        "heaps": heaps,
        "runs": runs,
        "guest_memory_warmup": warmed,
        "rows": rows,
        "table": tab,
        "security_cost": cost,
        "ratios": targets,
        "old_paths": {"changes": list(old_paths), "new_over_old": changed},
        "load": {
            "settings": list(load),
            "services": len(mesh.services) if mesh else 0,
            "rate_per_service": mesh.rate if mesh else 0,
            "on_over_off": loaded,
        },
    }
    (out_dir / "bench.json").write_text(json.dumps(summary, indent=2))
    md = markdown(tab) + (f"\n{memory.describe(warmed['effect'])}.\n" if "effect" in warmed else "")
    md += "".join(f"\n{note}.\n" for note in notes)
    md += breakdown.markdown(tab, targets) + (security_markdown(cost) if cost else "")
    md += paired_markdown(changed, "new path", "old path") if changed else ""
    md += paired_markdown(loaded, "load on", "load off") if loaded else ""
    (out_dir / "bench.md").write_text(md)
    return summary


def _fresh_pair(lab: Lab, heap: int, rows: list[dict[str, Any]], report: Report) -> None:
    """A fresh ``heap`` MB workload moved there and back before the guest memory is warmed; marked
    as warm-ups, so that no median includes them."""
    report(f"{heap} MB: two migrations before the guest memory warm-up, to say what it changes")
    try:
        _start_and_pair(lab, heap, "10.89.1.199", memory.BEFORE, rows, report, {})
    finally:
        with contextlib.suppress(UsageError):  # a start that failed left nothing to stop
            manage.stop(lab, f"bench{heap}")


def _start_and_pair(
    lab: Lab, heap: int, ip: str, label: str, rows: list[dict[str, Any]], report: Report, plan: dict[str, Any]
) -> str:
    """A fresh ``heap`` MB workload on node-a, moved to node-b and back by stop-copy/stream (with
    ``plan``'s settings); the two rows are warm-ups under ``label``. Returns the workload's name."""
    name = f"bench{heap}"
    with contextlib.suppress(UsageError):
        manage.stop(lab, name)
    manage.start(lab, name, "node-a", heap, ip=ip, report=report)
    for target in ("node-b", "node-a"):
        rec = migrate(lab, Plan(workload=name, target=target, transport="stream", **plan))
        rows.append(_row(label, heap, rec, warmup=True))
    return name


def _heap_runs(
    lab: Lab,
    heap: int,
    index: int,
    chosen: list[tuple[str, str, str, str]],
    runs: int,
    alternating: list[Variant],
    rows: list[dict[str, Any]],
    out_dir: Path,
    report: Report,
) -> None:
    """Every chosen method ``runs`` times at one heap size, each run in every variant; rows appended."""
    other = {"node-a": "node-b", "node-b": "node-a"}
    report(f"{heap} MB: starting the workload and warming up both nodes")
    # a static address: podman's create-image path keeps only those (the engine keeps any)
    ip = f"10.89.1.{200 + index}"
    name = _start_and_pair(lab, heap, ip, "warm-up stop-copy/stream", rows, report, alternating[0].plan)
    for label, mode, transport, compression in chosen:
        for i in range(runs):
            # the variants alternate within each run (and their order flips every run), so that
            # drift in the machine's speed falls on both alike
            for v in alternating if i % 2 == 0 else alternating[::-1]:
                v.apply()
                shown = f"{label} · {v.label}" if len(alternating) > 1 else label
                source = manage.locate(lab, name).node
                target = other[source]
                report(f"{heap} MB: {shown} run {i + 1}/{runs} ({source} -> {target})")
                rec: Mapping[str, Any]
                if mode == "podman-image":
                    rec = podman_paths.podman_image(lab, name, source, target)
                elif mode == "podman-one-node":
                    rec = podman_paths.podman_one_node(lab, name, source)
                else:
                    plan = Plan(name, target, mode, transport, compression, **v.plan)
                    rec = migrate(lab, plan)
                    # the copy's huge pages come back after the migration: their outcome is waited for
                    # here, so that the next run neither competes with that collapse nor misses it
                    rec = {**rec, "huge_pages": lazy.collapsed(lab, rec)}
                rows.append({**_row(shown, heap, rec), "variant": v.label})
                (out_dir / "rows.json").write_text(json.dumps(rows, indent=2))
    manage.stop(lab, name)


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (heap, method), warm-ups left out."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        if not r["warmup"]:
            groups.setdefault((r["heap_mb"], r["method"]), []).append(r)
    out = []
    for (heap, method), rs in groups.items():

        def med(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
            vals = [r[key] for r in rs if r.get(key) is not None]
            return round(statistics.median(vals), 3) if vals else None

        phases: dict[str, float] = {}
        for p in {p for r in rs for p in r["phase_s"]}:
            phases[p] = round(statistics.median([r["phase_s"][p] for r in rs if p in r["phase_s"]]), 3)
        out.append(
            {
                "heap_mb": heap,
                "method": method,
                "n": len(rs),
                "blackout_s": med("blackout_s"),
                "blackout_cutover_s": med("blackout_cutover_s"),
                "drift_counter": med("drift_counter"),
                "criu_frozen_s": med("criu_frozen_s"),
                "runtime_s": med("runtime_s"),
                "throughput_mb_s": med("throughput_mb_s"),
                "phase_s": phases,
                "state": rs[0]["state"],
                "archive_mib": round(a / 2**20, 2) if (a := med("archive_bytes")) is not None else None,
                "pushed_mib": round(b / 2**20, 2) if (b := med("pushed_bytes")) is not None else None,
                "sha256_verified": f"{sum(1 for r in rs if r.get('sha256_equal'))}/{len(rs)}",
                "blackout_steps": breakdown.steps_of(rs),
            }
        )
    return out


def variants(
    security: tuple[str, ...], old_paths: tuple[str, ...], load: tuple[str, ...], mesh: background.Load | None
) -> list[Variant]:
    """The variants a run alternates between (one, unlabelled, when nothing is compared). Security
    and old paths go into each migration's own plan: a migration of anyone else's on this lab in the
    meantime keeps its security and the new paths."""
    if mesh is not None:
        if len(load) > 1:
            return [Variant(f"load {x}", mesh.on if x == "on" else mesh.off, security=security[0]) for x in load]
        mesh.on()
    if len(security) > 1:
        return [Variant(f"security {s}", security=s) for s in security]
    if old_paths:
        chosen = paths.parse(",".join(old_paths))
        return [
            Variant("new path", security=security[0]),
            Variant(f"old path: {','.join(chosen)}", security=security[0], old_paths=chosen),
        ]
    return [Variant("", security=security[0])]


def paired(tab: list[dict[str, Any]], first: str, second: str) -> list[dict[str, Any]]:
    """Per heap and method: the median blackouts of two variants measured in one run, and their ratio."""
    by = {(r["heap_mb"], r["method"]): r for r in tab}
    out = []
    for (heap, method), a in sorted(by.items()):
        if not method.endswith(f" · {first}"):
            continue
        base = method.removesuffix(f" · {first}")
        b = by.get((heap, f"{base} · {second}"))
        if b is None or not a["blackout_s"] or not b["blackout_s"]:
            continue
        out.append(
            {
                "heap_mb": heap,
                "method": base,
                "n": min(a["n"], b["n"]),
                "blackout_a_s": a["blackout_s"],
                "blackout_b_s": b["blackout_s"],
                "ratio": round(a["blackout_s"] / b["blackout_s"], 3),
                "checkpoint_a_s": a["phase_s"].get("checkpoint"),
                "checkpoint_b_s": b["phase_s"].get("checkpoint"),
            }
        )
    return out


def security_cost(tab: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per heap and method: median blackout with sealing and CRIU's TLS on and off, and their ratio."""
    return [
        {
            "heap_mb": c["heap_mb"],
            "method": c["method"],
            "n": c["n"],
            "blackout_on_s": c["blackout_a_s"],
            "blackout_off_s": c["blackout_b_s"],
            "ratio": c["ratio"],
            "checkpoint_on_s": c["checkpoint_a_s"],
            "checkpoint_off_s": c["checkpoint_b_s"],
        }
        for c in paired(tab, "security on", "security off")
    ]


def security_markdown(cost: list[dict[str, Any]]) -> str:
    rows = [{**c, "blackout_a_s": c["blackout_on_s"], "blackout_b_s": c["blackout_off_s"]} for c in cost]
    return paired_markdown(rows, "security on", "off")


def paired_markdown(rows: list[dict[str, Any]], first: str, second: str) -> str:
    lines = [
        "",
        f"| heap MB | method | n | blackout, {first} s | {second} s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for c in rows:
        cells = [c["heap_mb"], c["method"], c["n"], c["blackout_a_s"], c["blackout_b_s"], c["ratio"]]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(tab: list[dict[str, Any]]) -> str:
    cols = ["checkpoint", "page-server", "push", "pull", "transfer", "stop", "start", "restore", "cutover", "pages"]
    lines = [
        "| heap MB | method | n | blackout s | at cutover s | drift (ticks) | CRIU frozen s | "
        + " | ".join(cols)
        + " | MB/s | state |",
        "|---|---|---|---|---|---|---|" + "---|" * len(cols) + "---|---|",
    ]
    for r in tab:
        cells = [str(r["phase_s"].get(c, "")) for c in cols]
        lines.append(
            f"| {r['heap_mb']} | {r['method']} | {r['n']} | {r['blackout_s']} | "
            f"{r['blackout_cutover_s'] if r['blackout_cutover_s'] is not None else ''} | "
            f"{r['drift_counter'] if r['drift_counter'] is not None else ''} | "
            f"{r['criu_frozen_s'] if r['criu_frozen_s'] is not None else ''} | "
            + " | ".join(cells)
            + f" | {r.get('throughput_mb_s') or ''} | {r['state']} |"
        )
    return "\n".join(lines) + "\n"
