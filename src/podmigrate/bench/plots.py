"""The report's PNG figures (matplotlib, Agg): blackout per mode, phases, probe timelines, and the
engine benchmark's blackout against heap size; ``report.build`` calls ``draw`` and embeds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from podmigrate.bench import breakdown


def draw(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Every figure the results in ``out_dir`` allow, written there as PNG; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[Path] = []
    groups = sorted({r["group"] for r in rows})
    if groups:  # an engine benchmark or sweep alone has no suite groups
        data = [[r["blackout_s"] for r in rows if r["group"] == g and not r["warmup"]] for g in groups]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.boxplot(data, tick_labels=groups, showfliers=False)
        for i, d in enumerate(data, start=1):
            ax.scatter([i] * len(d), d, s=10, alpha=0.6)
        ax.set_ylabel("blackout (s)")
        ax.set_title("Blackout per mode (each dot one migration)")
        fig.tight_layout()
        made.append(out_dir / "blackout-by-mode.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)

    phase_groups = [g for g in groups if g != "cold"]
    if phase_groups:
        phases = ["checkpoint", "page-server", "push", "pull", "transfer", "restore", "cutover"]
        fig, ax = plt.subplots(figsize=(8, 4))
        bottom = [0.0] * len(phase_groups)
        for ph in phases:
            vals = []
            for g in phase_groups:
                xs = [r["phase_s"].get(ph, 0.0) for r in rows if r["group"] == g and not r["warmup"]]
                vals.append(sorted(xs)[len(xs) // 2] if xs else 0.0)
            if any(vals):
                ax.bar(phase_groups, vals, bottom=bottom, label=ph)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("seconds (median)")
        ax.set_title("Phase breakdown")
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(out_dir / "phases.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)

    engine_file = out_dir / "bench.json"
    if engine_file.exists():
        engine_table = json.loads(engine_file.read_text())["table"]
        made += draw_engine(engine_table, out_dir, plt)
        made += breakdown.draw(engine_table, out_dir, plt)

    for g in groups:
        log, meta = out_dir / f"probe-{g}.json", out_dir / f"probe-{g}.meta.json"
        if not log.exists():
            continue
        recs = json.loads(log.read_text())
        m = json.loads(meta.read_text())
        t0 = m.get("freeze_started") or min(r["sent"] for r in recs)
        fig, ax = plt.subplots(figsize=(8, 2.5))
        ok = [(r["sent"] - t0, r["answered"] - r["sent"]) for r in recs if r["ok"]]
        bad = [(r["sent"] - t0, r["answered"] - r["sent"]) for r in recs if not r["ok"]]
        for pts, label, color in ((ok, "answered", "tab:green"), (bad, "failed", "tab:red")):
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, label=label, color=color)
        if m.get("cutover"):
            ax.axvline(m["cutover"] - t0, color="k", linestyle="--", linewidth=1, label="route switch")
        ax.set_xlabel("seconds from the checkpoint's start")
        ax.set_ylabel("latency (s)")
        ax.set_title(f"Probe timeline, {g} ({m['id']})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        made.append(out_dir / f"timeline-{g}.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def draw_engine(table: list[dict[str, Any]], out_dir: Path, plt: Any) -> list[Path]:
    """From an engine benchmark or sweep: blackout against heap size per method, and the phases of
    each method stacked per heap size."""
    made: list[Path] = []
    methods = sorted({t["method"] for t in table})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m in methods:
        pts = sorted((t["heap_mb"], t["blackout_s"]) for t in table if t["method"] == m and t["blackout_s"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("heap (MB)")
    ax.set_ylabel("blackout (s, median)")
    ax.set_title("Blackout against heap size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    made.append(out_dir / "blackout-vs-heap.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    phases = ["checkpoint", "page-server", "push", "pull", "transfer", "stop", "start", "restore", "cutover"]
    heaps = sorted({t["heap_mb"] for t in table})
    fig, axes = plt.subplots(1, len(heaps), figsize=(4 * len(heaps), 4.5), squeeze=False)
    for ax, heap in zip(axes[0], heaps, strict=True):
        rows = [t for t in table if t["heap_mb"] == heap]
        bottom = [0.0] * len(rows)
        for ph in phases:
            vals = [float(t["phase_s"].get(ph, 0.0)) for t in rows]
            if any(vals):
                ax.bar(range(len(rows)), vals, bottom=bottom, label=ph)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(rows)), [t["method"] for t in rows], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{heap} MB")
        ax.set_ylabel("seconds (median)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    made.append(out_dir / "phases-by-heap.png")
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    return made
