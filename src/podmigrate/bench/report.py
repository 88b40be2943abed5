"""The report: Markdown and a self-contained HTML page with PNG plots, from a suite's results.

It describes every group (warm-ups left out), tests each migration mode against cold restart,
sets our figures beside the study's published ones, and budgets a Spot evacuation. Engine benchmark
results (``bench.json`` from ``podmigrate bench engine``) in the same directory are added when present.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

from podmigrate.bench import stats, suite

# The study (shared/seed/study.md): medians in seconds
STUDY = {
    "decoupled": ("Mode A (decoupled) median cutover blackout", 1.0645),
    "stop-copy": ("Mode B (stop-and-copy) blackout", 1.878),
    "cold": ("Cold reschedule median blackout", 1.019),
}
STUDY_EVACUATION_1GB_S = 36.78
# The study's heap sweep (its third table): layer MiB, RPO gzip / uncompressed (-D) s, worst case -D s,
# share of the 120 s Spot notice
STUDY_SWEEP = {
    26: (5.16, 0.67, 0.56, 5.70, 0.048),
    64: (69.11, 1.38, 0.98, 6.19, 0.052),
    128: (133.11, 2.01, 1.46, 6.71, 0.056),
    256: (261.13, 7.48, 3.16, 8.53, 0.071),
    512: (517.15, 19.39, 7.48, 13.24, 0.110),
    1024: (1029.21, 42.63, 24.31, 36.78, 0.306),
}
LIFECYCLE = {
    "decoupled": "serves until its copy is up",
    "stop-copy": "frozen at the checkpoint, removed once the copy serves",
    "lazy": "frozen at the checkpoint, serves pages until all moved",
    "cold": "stopped at once",
}

DEFINITION = (
    "Blackout: probes from the LAN namespace every 20 ms, each a new TCP connection with a 1 s timeout "
    "(`GET /healthz`). A probe succeeds when it got a 200 within its timeout. Within the migration's window, "
    "the longest run of failed probes (by send time) counts, from the last moment the service was seen up "
    "before it to the answer of the first success after it. The study probed at 50 Hz from outside the "
    "cluster; SHADOW counts DOWN samples of a 10 ms prober; Schrettenbrunner probes every 500 ms. "
    "For decoupled migrations the whole-window figure includes the short CRIU freeze at the checkpoint; "
    "'at cutover' is the study's cutover blackout."
)


def _plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
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
        made += _engine_plots(json.loads(engine_file.read_text())["table"], out_dir, plt)

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


def _engine_plots(table: list[dict[str, Any]], out_dir: Path, plt: Any) -> list[Path]:
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


def build(out_dir: Path) -> dict[str, Any]:
    """The report of a suite (``suite.jsonl``), an engine benchmark or sweep (``bench.json``), or both."""
    rows = suite.load(out_dir)
    if not rows and not (out_dir / "bench.json").exists():
        raise FileNotFoundError(f"no results in {out_dir}: neither suite.jsonl nor bench.json")
    mach = json.loads((out_dir / "machine.json").read_text()) if (out_dir / "machine.json").exists() else {}
    measured = [r for r in rows if not r["warmup"]]
    groups = sorted({r["group"] for r in measured})
    desc = {g: stats.describe([r["blackout_s"] for r in measured if r["group"] == g]) for g in groups}
    at_cut = {
        g: stats.describe(
            [r["blackout_cutover_s"] for r in measured if r["group"] == g and r.get("blackout_cutover_s") is not None]
        )
        for g in groups
    }
    cold = [r["blackout_s"] for r in measured if r["group"] == "cold"]
    tests = {
        g: stats.compare([r["blackout_s"] for r in measured if r["group"] == g], cold) for g in groups if g != "cold"
    }
    side = []
    for g, (label, theirs) in STUDY.items():
        d = at_cut.get(g) if g == "decoupled" else desc.get(g)
        if d and d.get("n"):
            side.append(
                {
                    "metric": label,
                    "study_s": theirs,
                    "ours_s": round(d["median"], 4),
                    "ratio": round(d["median"] / theirs, 3),
                }
            )
    budget = []
    sc = [r for r in measured if r["group"] == "stop-copy"]
    if sc:
        src = sorted(r["phase_s"].get("checkpoint", 0) + r["phase_s"].get("transfer", 0) for r in sc)[len(sc) // 2]
        budget = stats.spot_budget(src)
    engine = json.loads((out_dir / "bench.json").read_text())["table"] if (out_dir / "bench.json").exists() else []
    one_gb = [e for e in engine if e["heap_mb"] == 1024 and e["method"] == "stop-copy/stream"]
    if one_gb:
        ph = one_gb[0]["phase_s"]
        evac = ph.get("checkpoint", 0) + ph.get("page-server", 0) + ph.get("transfer", 0)
        side.append(
            {
                "metric": "1 GB evacuation (source-side work), stop-copy",
                "study_s": STUDY_EVACUATION_1GB_S,
                "ours_s": round(evac, 3),
                "ratio": round(evac / STUDY_EVACUATION_1GB_S, 3),
            }
        )
    quality = {
        "counter_went_backwards_outside_cold_or_decoupled": sum(
            1 for r in measured if r.get("counter_backwards") and r["group"] not in ("cold", "decoupled")
        ),
        "heap_digest_mismatches": sum(1 for r in measured if r.get("sha256_equal") is False),
        "prober_schedule_error_max_s": max((r.get("schedule_error_max_s") or 0 for r in measured), default=None),
    }
    result = {
        "created": time.time(),
        "machine": mach,
        "groups": desc,
        "at_cutover": at_cut,
        "vs_cold": tests,
        "study_side_by_side": side,
        "spot_budget": budget,
        "quality": quality,
        "engine": engine,
        "study_tables": study_tables(measured, desc, at_cut, tests, engine),
    }
    (out_dir / "report.json").write_text(json.dumps(result, indent=2))
    plots = _plots(rows, out_dir)
    md = markdown(result, plots)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(html(md, plots))
    return result


def study_tables(
    measured: list[dict[str, Any]],
    desc: dict[str, Any],
    at_cut: dict[str, Any],
    tests: dict[str, Any],
    engine: list[dict[str, Any]],
) -> dict[str, list[dict[str, Any]]]:
    """The study's three tables, regenerated from our data, with its published figures beside ours."""
    out: dict[str, list[dict[str, Any]]] = {}
    dec, cold = at_cut.get("decoupled") or {}, desc.get("cold") or {}
    if dec.get("n") and cold.get("n"):
        t = tests.get("decoupled", {})
        kept = [r for r in measured if r["group"] == "decoupled" and r.get("sha256_equal") is not None]
        preserved = f"{sum(1 for r in kept if r['sha256_equal'])}/{len(kept)} SHA-256 equal"
        out["mode_a_vs_cold"] = [
            {"metric": "median cutover blackout", "ours": (dec["median"], cold["median"]), "study": (1.0645, 1.019)},
            {"metric": "mean cutover blackout", "ours": (dec["mean"], cold["mean"]), "study": (None, None)},
            {
                "metric": "Mann-Whitney U p (decoupled whole window vs cold)",
                "ours": (t.get("mann_whitney_p"), None),
                "study": ("not significant", None),
            },
            {"metric": "Welch t-test p", "ours": (t.get("welch_p"), None), "study": ("not significant", None)},
            {"metric": "RAM state", "ours": (preserved, "lost (fresh start)"), "study": ("100% intact", "0% (reset)")},
        ]
    modes = []
    published = {"decoupled": (1.0645, 0.797, "bounded"), "stop-copy": (1.878, None, "0"), "cold": (1.019, None, "all")}
    for g, study in published.items():
        d = (at_cut if g == "decoupled" else desc).get(g) or {}
        if not d.get("n"):
            continue
        drift = sorted(r["drift_s"] for r in measured if r["group"] == g and r.get("drift_s") is not None)
        if g == "cold":
            rpo = "state lost"
        elif g == "decoupled" and drift:
            rpo = f"{drift[len(drift) // 2]:.2f} s of serving after the checkpoint (median)"
        else:
            rpo = "0"
        modes.append(
            {
                "mode": g,
                "source": LIFECYCLE[g],
                "blackout_p50": d["median"],
                "blackout_best": d["min"],
                "drift": rpo,
                "study": study,
            }
        )
    if modes:
        out["modes"] = modes
    by = {(e["heap_mb"], e["method"]): e for e in engine}
    sweep = []
    for heap in sorted({e["heap_mb"] for e in engine}):
        plain, gz = by.get((heap, "stop-copy/registry")), by.get((heap, "stop-copy/registry+gzip"))
        stream = by.get((heap, "stop-copy/stream"))
        if not plain:
            continue

        def source_side(e: dict[str, Any] | None) -> float | None:
            return round(e["phase_s"].get("checkpoint", 0) + e["phase_s"].get("push", 0), 3) if e else None

        worst = round(stats.DETECTION_WORST_S + (source_side(plain) or 0), 3)
        sweep.append(
            {
                "heap_mb": heap,
                "layer_mib": plain.get("archive_mib"),
                "layer_gzip_mib": gz.get("pushed_mib") if gz else None,
                "criu_frozen_s": plain.get("criu_frozen_s"),
                "rpo_gzip_s": source_side(gz),
                "rpo_plain_s": source_side(plain),
                "worst_plain_s": worst,
                "spot_share": round(worst / 120, 3),
                "pull_restore_s": round(plain["phase_s"].get("pull", 0) + plain["phase_s"].get("restore", 0), 3),
                "stream_blackout_s": stream.get("blackout_s") if stream else None,
                "sha256": plain.get("sha256_verified"),
                "study": STUDY_SWEEP.get(heap),
            }
        )
    if sweep:
        out["heap_sweep"] = sweep
    return out


def _study_markdown(t: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines: list[str] = []
    if "mode_a_vs_cold" in t:
        lines += [
            "",
            "## The study's table 1: decoupled migration against cold reschedule (ours / study)",
            "",
            "| metric | decoupled: ours | cold: ours | decoupled: study | cold: study |",
            "|---|---|---|---|---|",
        ]
        for r in t["mode_a_vs_cold"]:
            o, st = r["ours"], r["study"]
            lines.append(f"| {r['metric']} | {_g(o[0])} | {_g(o[1])} | {_g(st[0])} | {_g(st[1])} |")
    if "modes" in t:
        lines += [
            "",
            "## The study's table 2: the modes side by side (blackout in seconds; ours / study)",
            "",
            "| mode | source | blackout p50 | best | drift (RPO) | study p50 | study best | study drift |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in t["modes"]:
            st = r["study"]
            lines.append(
                f"| {r['mode']} | {r['source']} | {_g(r['blackout_p50'])} | {_g(r['blackout_best'])} | {r['drift']} | "
                f"{_g(st[0])} | {_g(st[1])} | {st[2]} |"
            )
    if "heap_sweep" in t:
        lines += [
            "",
            "## The study's table 3: heap sweep (stop-copy through the registry; seconds; study in brackets)",
            "",
            "RPO = source-side work (checkpoint + push); worst case = 5 s detection + RPO uncompressed.",
            "",
            "| heap MB | layer MiB | gzip layer MiB | CRIU frozen | RPO gzip | RPO none | worst case | of 120 s | "
            "pull + restore | stop-copy stream blackout | SHA-256 |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in t["heap_sweep"]:
            st = r["study"] or (None,) * 5
            lines.append(
                f"| {r['heap_mb']} | {_g(r['layer_mib'])} [{_g(st[0])}] | {_g(r['layer_gzip_mib'])} | "
                f"{_g(r['criu_frozen_s'])} | {_g(r['rpo_gzip_s'])} [{_g(st[1])}] | "
                f"{_g(r['rpo_plain_s'])} [{_g(st[2])}] | "
                f"{_g(r['worst_plain_s'])} [{_g(st[3])}] | {r['spot_share']:.1%} [{_pct(st[4])}] | "
                f"{_g(r['pull_restore_s'])} | {_g(r['stream_blackout_s'])} | {r['sha256']} |"
            )
    return lines


def _g(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 0.001 else f"{x:.3f}".rstrip("0").rstrip(".")
    return str(x)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x:.1%}"


def _f(x: Any, digits: int = 3) -> str:
    return "" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def markdown(r: dict[str, Any], plots: list[Path]) -> str:
    m = r["machine"]
    lines = [
        "# podmigrate report",
        "",
        f"Machine: {m.get('cores')} cores, {m.get('memory_gib')} GiB, kernel {m.get('kernel')}, "
        f"CRIU {m.get('criu')}, Podman {m.get('podman')}, runc {m.get('runc')}"
        + (f"; heap {m['heap_mb']} MB" if m.get("heap_mb") else "")
        + (f"; guest memory warmed: {w['gib']} GiB" if (w := m.get("guest_memory_warmup")) else "")
        + ".",
        "",
        "## Definition",
        "",
        DEFINITION,
        "",
        "## Blackout per group (seconds; warm-up runs excluded)",
        "",
        "| group | n | median | 95% CI of median | mean | stdev | p5 | p95 | min | max | median at cutover |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g, d in r["groups"].items():
        ci = d.get("median_ci95") or [None, None]
        cut = r["at_cutover"].get(g, {})
        lines.append(
            f"| {g} | {d['n']} | {_f(d['median'])} | {_f(ci[0])}-{_f(ci[1])} | {_f(d['mean'])} | "
            f"{_f(d['stdev'])} | {_f(d['p5'])} | {_f(d['p95'])} | {_f(d['min'])} | {_f(d['max'])} | "
            f"{_f(cut.get('median'))} |"
        )
    lines += [
        "",
        "## Each mode against cold restart (two-sided)",
        "",
        "| mode | n vs n | median diff (s) | Mann-Whitney U | p | rank-biserial | Welch t | p | Cohen's d |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g, t in r["vs_cold"].items():
        if "mann_whitney_u" in t:
            lines.append(
                f"| {g} | {t['n_a']} vs {t['n_b']} | {_f(t['median_difference'])} | "
                f"{_f(t['mann_whitney_u'], 1)} | {t['mann_whitney_p']:.3g} | {_f(t['rank_biserial'])} | "
                f"{_f(t['welch_t'])} | {t['welch_p']:.3g} | {_f(t['cohens_d'])} |"
            )
        else:
            lines.append(f"| {g} | {t['n_a']} vs {t['n_b']} | {t.get('note')} |||||||")
    lines += ["", "## Beside the study", "", "| metric | study | ours | ours / study |", "|---|---|---|---|"]
    for s in r["study_side_by_side"]:
        lines.append(f"| {s['metric']} | {s['study_s']} s | {s['ours_s']} s | {s['ratio']} |")
    if r["spot_budget"]:
        lines += [
            "",
            "## Spot-deadline budget (worst-case detection 5 s + stop-copy source-side work)",
            "",
            "| deadline | used | share | fits |",
            "|---|---|---|---|",
        ]
        for b in r["spot_budget"]:
            lines.append(f"| {b['deadline']} | {b['used_s']} s | {b['share']:.1%} | {b['fits']} |")
    if r["engine"]:
        lines += [
            "",
            "## Engine benchmark (medians)",
            "",
            "| heap MB | method | n | blackout s | at cutover s |",
            "|---|---|---|---|---|",
        ]
        for e in r["engine"]:
            lines.append(
                f"| {e['heap_mb']} | {e['method']} | {e['n']} | {e['blackout_s']} | {_f(e.get('blackout_cutover_s'))} |"
            )
    lines += _study_markdown(r["study_tables"])
    q = r["quality"]
    lines += [
        "",
        "## Checks",
        "",
        f"- heap digest mismatches: {q['heap_digest_mismatches']}",
        f"- counter went backwards (stop-copy/lazy, where it must not): "
        f"{q['counter_went_backwards_outside_cold_or_decoupled']}",
        f"- prober's worst scheduling error: {_g(q['prober_schedule_error_max_s'])} s",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def html(md: str, plots: list[Path]) -> str:
    """A self-contained page: the Markdown as preformatted text and the plots inline."""
    import html as h

    imgs = "".join(
        f'<h3>{h.escape(p.stem)}</h3><img alt="{h.escape(p.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for p in plots
    )
    body = "\n".join(line for line in md.splitlines() if not line.startswith("!["))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>podmigrate report</title>"
        f"<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}pre{{white-space:pre-wrap}}"
        f"img{{max-width:100%}}</style></head><body><pre>{h.escape(body)}</pre>{imgs}</body></html>"
    )
