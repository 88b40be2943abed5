"""The report: Markdown and a self-contained HTML page with PNG plots, from a suite's results.

It describes every group (warm-ups left out), tests each migration mode against cold restart,
sets our figures beside the study's published ones, and budgets a Spot evacuation. Engine benchmark
results (``bench.json`` from ``podmigrate bench engine``), ``bench k8s`` and ``bench evacuate`` ones in the
same directory are added when present.
Neighbours: ``stats`` (the tests), ``study`` (the study's figures and tables), ``plots`` (the PNGs).
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

from podmigrate.bench import breakdown, evacuate, k8s, stats, suite
from podmigrate.bench.plots import draw
from podmigrate.bench.study import fmt, side_by_side, study_markdown, study_tables

DEFINITION = (
    "Blackout: probes from the LAN namespace every 20 ms, each a new TCP connection with a 1 s timeout "
    "(`GET /healthz`). A probe succeeds when it got a 200 within its timeout. Within the migration's window, "
    "the longest run of failed probes (by send time) counts, from the last moment the service was seen up "
    "before it to the answer of the first success after it. The study probed at 50 Hz from outside the "
    "cluster; SHADOW counts DOWN samples of a 10 ms prober; Schrettenbrunner probes every 500 ms. "
    "For decoupled migrations the whole-window figure includes the short CRIU freeze at the checkpoint; "
    "'at cutover' is the study's cutover blackout."
)


def build(out_dir: Path) -> dict[str, Any]:
    """The report of a suite (``suite.jsonl``), an engine benchmark or sweep (``bench.json``), or both."""
    rows = suite.load(out_dir)
    sources = ("bench.json", "k8s.json", "evacuate.json")
    if not rows and not any((out_dir / f).exists() for f in sources):
        raise FileNotFoundError(f"no results in {out_dir}: no suite.jsonl, {', '.join(sources)}")
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
    budget = []
    sc = [r for r in measured if r["group"] == "stop-copy"]
    if sc:
        src = sorted(r["phase_s"].get("checkpoint", 0) + r["phase_s"].get("transfer", 0) for r in sc)[len(sc) // 2]
        budget = stats.spot_budget(src)
    bench = json.loads((out_dir / "bench.json").read_text()) if (out_dir / "bench.json").exists() else {}
    engine = bench.get("table", [])
    side = side_by_side(desc, at_cut, engine)
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
        "engine_ratios": bench.get("ratios", []),
        "study_tables": study_tables(measured, desc, at_cut, tests, engine),
        "k8s": json.loads((out_dir / "k8s.json").read_text()) if (out_dir / "k8s.json").exists() else None,
        "evacuation": _evacuation(out_dir),
    }
    (out_dir / "report.json").write_text(json.dumps(result, indent=2))
    made = draw(rows, out_dir) if rows or engine else []
    k8s_result: dict[str, Any] | None = result["k8s"]
    if k8s_result and (k8s_plot := k8s.draw(k8s_result, out_dir)):
        made.append(k8s_plot)
    md = markdown(result, made)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(html(md, made))
    return result


def _evacuation(out_dir: Path) -> dict[str, Any] | None:
    """``podmigrate bench evacuate``'s summary (without its per-run records), if it ran here."""
    path = out_dir / "evacuate.json"
    if not path.exists():
        return None
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "rows"}


def _f(x: Any, digits: int = 3) -> str:
    return "" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def markdown(r: dict[str, Any], plots: list[Path]) -> str:
    m = r["machine"]
    lines = ["# podmigrate report"]
    if m:  # recorded by the suite and the engine benchmark; bench k8s and evacuate write none
        lines += [
            "",
            f"Machine: {m.get('cores')} cores, {m.get('memory_gib')} GiB, kernel {m.get('kernel')}, "
            f"CRIU {m.get('criu')}, Podman {m.get('podman')}, runc {m.get('runc')}"
            + (f"; heap {m['heap_mb']} MB" if m.get("heap_mb") else "")
            + (f"; guest memory warmed: {w['gib']} GiB" if (w := m.get("guest_memory_warmup")) else "")
            + ".",
        ]
    if r["groups"]:  # the suite's sections, only where a suite ran
        lines += ["", *_suite(r)]
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
        lines += breakdown.markdown(r["engine"], r.get("engine_ratios") or []).splitlines()
    if r.get("k8s"):
        lines += ["", *k8s.markdown(r["k8s"])]
    if r.get("evacuation"):
        lines += ["", "## Evacuating a node (`podmigrate bench evacuate`)", "", evacuate.markdown(r["evacuation"])]
    lines += study_markdown(r["study_tables"])
    q = r["quality"]
    if r["groups"]:  # the suite's own checks (the other benchmarks state theirs in their sections)
        lines += [
            "",
            "## Checks",
            "",
            f"- heap digest mismatches: {q['heap_digest_mismatches']}",
            f"- counter went backwards (stop-copy/lazy, where it must not): "
            f"{q['counter_went_backwards_outside_cold_or_decoupled']}",
            f"- prober's worst scheduling error: {fmt(q['prober_schedule_error_max_s'])} s",
        ]
    lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _suite(r: dict[str, Any]) -> list[str]:
    """The suite's sections: the blackout's definition, its groups, each mode against cold, the study."""
    lines = [
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
    return lines


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
