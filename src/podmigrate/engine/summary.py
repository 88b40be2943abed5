"""The headline figures of a finished lab migration, derived from its phases and measurements.

Neighbours: ``engine.controller`` calls ``summarize`` once a migration completed; ``bench`` and the
CLI read the fields it writes (documented in ``engine.record.Record``).
"""

from __future__ import annotations

from podmigrate.engine import breakdown
from podmigrate.engine.record import Record


def summarize(rec: Record) -> None:
    ph = {p["name"]: p for p in rec["phases"]}
    rec["phase_s"] = {n: round(p["ended"] - p["started"], 4) for n, p in ph.items() if "ended" in p}
    b = rec.get("blackout")
    if b and b.get("first_ok_after"):
        rec["blackout_s"] = b["blackout_s"]
        rec["blackout_method"] = "probe"
    elif rec["mode"] == "park":  # nobody serves until a restore: that one measures the outage
        rec["blackout_method"] = "parked: the service is down until `podmigrate restore`"
    else:  # (a restore: from the park's freeze to the copy's first answer)
        end = rec.get("first_answer_at") or ph["cutover"]["ended"]
        rec["blackout_s"] = round(end - rec["freeze_started"], 4)
        rec["blackout_method"] = "controller"
    if b and b.get("at_cutover"):
        rec["blackout_cutover_s"] = b["at_cutover"]["blackout_s"]
    nbytes = rec.get("bytes", {})
    # bytes that crossed the LAN: twice through the registry, once when streamed
    rec["bytes_moved"] = (
        nbytes.get("pushed", 0) + nbytes.get("pulled", 0) + nbytes.get("sent", 0) + nbytes.get("pages", 0)
    )
    if nbytes.get("pages") and rec["mode"] == "lazy":  # from the restore until the last page arrived
        total = rec["lazy"]["all_pages_at"] - ph["restore"]["ended"]
        moved = nbytes["pages"]
    elif nbytes.get("pages"):  # the pages moved during the dump itself
        total = rec["phase_s"].get("checkpoint", 0) + rec["phase_s"].get("transfer", 0)
        moved = nbytes["pages"] + nbytes.get("sent", 0)
    else:
        total = sum(rec["phase_s"].get(p, 0) for p in ("push", "pull", "transfer"))
        moved = nbytes.get("archive", 0)
    rec["throughput_mb_s"] = round(moved / 2**20 / total, 1) if total else None
    # a parked workload's outage is mostly the time it waited in the registry: no steps to split
    split = None if rec["mode"] == "park" or rec.get("scope") == "parked" else breakdown.steps(rec)
    if split is not None:
        rec["blackout_steps"] = split
