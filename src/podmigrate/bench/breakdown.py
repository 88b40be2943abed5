"""The engine benchmark's view of where blackouts go, and the ratios it is judged by.

Per (heap, method) the steps of the run with the median blackout (``engine.breakdown``: its steps
add up to that run's blackout exactly, which medians taken step by step would not), drawn as a
stacked bar; and the ratios of issue 14, each measured within one run of the benchmark, with its
target: lazy against the cold restart, lazy's flatness in heap size, the streamed stop-and-copy
against Podman's own export/import, and failed probes at a decoupled cutover.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

LAZY, COLD, STREAM = "lazy (post-copy)", "cold restart", "stop-copy/stream"
PODMAN = "podman archive (export/copy/import)"
ONE_NODE = "podman-one-node (export/import)"  # bench.podman_paths: Podman's own path, on one node


def median_run(rs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run whose blackout is the median (the lower middle one for an even count)."""
    with_steps = sorted((r for r in rs if r.get("blackout_steps")), key=lambda r: r["blackout_s"] or 0.0)
    return with_steps[(len(with_steps) - 1) // 2] if with_steps else None


def steps_of(rs: list[dict[str, Any]]) -> dict[str, Any] | None:
    run = median_run(rs)
    return {"run": run["id"], **run["blackout_steps"]} if run else None


def _blackout(tab: list[dict[str, Any]], heap: int, method: str) -> float | None:
    return next((t["blackout_s"] for t in tab if t["heap_mb"] == heap and t["method"] == method), None)


def ratios(tab: list[dict[str, Any]], rows: list[dict[str, Any]], variant: str = "") -> list[dict[str, Any]]:
    """The targets, from the medians of this run: what was measured, the ratio and whether it holds
    (of the methods run as ``variant``, when the run alternated between variants)."""
    if variant:
        end = f" · {variant}"
        tab = [{**t, "method": t["method"].removesuffix(end)} for t in tab if t["method"].endswith(end)]
        rows = [{**r, "method": r["method"].removesuffix(end)} for r in rows if r["method"].endswith(end)]
    heaps = sorted({t["heap_mb"] for t in tab})
    out: list[dict[str, Any]] = []

    def add(what: str, a: float | None, b: float | None, target: str, holds: Any) -> None:
        if a and b:
            r = round(a / b, 3)
            out.append({"ratio": what, "value": r, "target": target, "holds": bool(holds(r)), "variant": variant})

    if not heaps:
        return out
    small, big = heaps[0], heaps[-1]
    add(
        f"lazy / cold at {small} MB", _blackout(tab, small, LAZY), _blackout(tab, small, COLD), "<= 1", lambda r: r <= 1
    )
    if big != small:
        lazy_big, cold_big = _blackout(tab, big, LAZY), _blackout(tab, big, COLD)
        add(f"lazy / cold at {big} MB", lazy_big, cold_big, "<= 0.5", lambda r: r <= 0.5)
        add(f"lazy {big} MB / lazy {small} MB", lazy_big, _blackout(tab, small, LAZY), "<= 1.1", lambda r: r <= 1.1)
    stream = _blackout(tab, big, STREAM)
    add(f"podman export+import on one node / stop-copy/stream at {big} MB", _blackout(tab, big, ONE_NODE),
        stream, ">= 6", lambda r: r >= 6)  # fmt: skip
    add(f"podman export, copy, import between nodes / stop-copy/stream at {big} MB", _blackout(tab, big, PODMAN),
        stream, ">= 6", lambda r: r >= 6)  # fmt: skip
    decoupled = [r for r in rows if not r["warmup"] and r["method"].startswith("decoupled/")]
    if decoupled:
        failed = sum(int(r.get("cutover_failed_probes") or 0) for r in decoupled)
        out.append({"ratio": f"failed probes at decoupled cutovers ({len(decoupled)} runs)", "value": failed,
                    "target": "0", "holds": failed == 0, "variant": variant})  # fmt: skip
    return out


def prefetches(rows: list[dict[str, Any]]) -> str | None:
    """How often the lazy runs' small-mapping pages were there when the restore began (agent.node_prefetch)."""
    lazy = [r for r in rows if r["method"].startswith("lazy") and not r.get("warmup")]
    if not lazy:
        return None
    got = [r.get("prefetch") or {} for r in lazy]
    used = [g for g in got if g.get("outcome") == "used"]
    missed = sum(g.get("outcome") == "missed" for g in got)
    mb = statistics.median(g.get("bytes", 0) for g in used) / 2**20 if used else 0.0
    return (
        f"lazy prefetch: swapped in before the restore in {len(used)} of {len(lazy)} lazy runs "
        f"(median {mb:.1f} MB), too late in {missed}, not sent in {len(lazy) - len(used) - missed}"
    )


def huge_pages(rows: list[dict[str, Any]]) -> str | None:
    """How much of the lazily filled copies' memory went back into huge pages (runtime.hugepages)."""
    got = [r["huge_pages"] for r in rows if r.get("huge_pages") and not r.get("warmup")]
    if not got:
        return None
    asked = sum(g.get("bytes", 0) for g in got)
    done = sum(g.get("collapsed_bytes", 0) for g in got)
    secs = statistics.median(g.get("seconds", 0.0) for g in got)
    return (
        f"huge pages: {done / 2**20:.0f} of {asked / 2**20:.0f} MB collapsed back after {len(got)} lazily "
        f"filled restores (median {secs:.2f} s each, after the blackout)"
    )


def markdown(tab: list[dict[str, Any]], ratio_rows: list[dict[str, Any]]) -> str:
    lines = ["", "Where the blackout goes (the run with the median blackout, seconds):", ""]
    for t in tab:
        st = t.get("blackout_steps")
        if not st:
            continue
        parts = ", ".join(f"{w} {s}" for w, s in st["steps"].items())
        lines.append(
            f"- {t['heap_mb']} MB {t['method']}: {st['window_s']} s = {parts}, unaccounted {st['unaccounted_s']}"
        )
    if ratio_rows:
        lines += ["", "| ratio (medians of this run) | value | target | holds |", "|---|---|---|---|"]
        lines += [
            f"| {r['ratio']}{' · ' + r['variant'] if r.get('variant') else ''} | {r['value']} | {r['target']} | "
            f"{'yes' if r['holds'] else 'NO'} |"
            for r in ratio_rows
        ]
    return "\n".join(lines) + "\n"


def draw(tab: list[dict[str, Any]], out_dir: Path, plt: Any) -> list[Path]:
    """A stacked bar per method and heap: the steps of its median run, unaccounted in grey on top."""
    rows = [t for t in tab if t.get("blackout_steps")]
    if not rows:
        return []
    names: list[str] = []
    for t in rows:
        names += [w for w in t["blackout_steps"]["steps"] if w not in names]
    # the few biggest steps by name, the rest summed, so that the legend stays readable
    weight = {w: statistics.fmean(t["blackout_steps"]["steps"].get(w, 0.0) for t in rows) for w in names}
    shown = sorted(names, key=lambda w: -weight[w])[:11]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 3), 5))
    bottom = [0.0] * len(rows)
    cmap = plt.get_cmap("tab20")
    for i, w in enumerate([w for w in names if w in shown]):
        vals = [t["blackout_steps"]["steps"].get(w, 0.0) for t in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=w, color=cmap(i % 20))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    rest = [sum(s for w, s in t["blackout_steps"]["steps"].items() if w not in shown) for t in rows]
    if any(rest):
        ax.bar(range(len(rows)), rest, bottom=bottom, label="other steps", color="tab:brown")
        bottom = [b + v for b, v in zip(bottom, rest, strict=True)]
    ax.bar(range(len(rows)), [t["blackout_steps"]["unaccounted_s"] for t in rows], bottom=bottom,
           label="unaccounted", color="lightgrey", hatch="//")  # fmt: skip
    ax.set_xticks(range(len(rows)), [f"{t['method']}\n{t['heap_mb']} MB" for t in rows], rotation=60, ha="right",
                  fontsize=7)  # fmt: skip
    ax.set_ylabel("seconds (the median run's blackout)")
    ax.set_title("Where the blackout goes")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = out_dir / "blackout-steps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
