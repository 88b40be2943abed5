"""Guest-memory warm-up before a benchmark.

On this kind of VM the first touch of never-used guest memory costs ~2.75 s/GB (the hypervisor backs
the page then), reused memory ~0.10 s/GB (``shared/lab-notes.md``). A restore writes a whole heap into
fresh pages, so whichever run first gets never-touched memory pays seconds that have nothing to do
with migration. Touching most of free memory once, before measuring, makes every run meet the same
(reused) memory; the benchmark records that it did so and how long it took.
"""

from __future__ import annotations

import mmap
import statistics
import time
from typing import Any

GIB = 1 << 30
PAGE = mmap.PAGESIZE
# the label of the benchmark's migrations before the warm-up (``effect`` finds them by it)
BEFORE = "before guest-memory warm-up stop-copy/stream"


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable"))
    return kb / 2**20


def need_gib(heaps_mb: list[int], copies: int = 3) -> float:
    """What a benchmark's migrations touch at most: the largest heap's source, its copy on the target
    and its checkpoint images in the page cache (``copies`` of it; an evacuation passes the whole
    node's heaps), plus 1 GiB of podman, CRIU and the agents."""
    return copies * max(heaps_mb, default=0) / 1024 + 1.0


def warm(gib: float | None, need: float, keep_free_gib: float = 4.0) -> dict[str, Any]:
    """Touch ``gib`` GiB once, then free it; ``None``: what this benchmark may take, ``need`` GiB
    (``need_gib``), and never more than leaves ``keep_free_gib`` to whatever else runs here: other
    labs and users share the machine, and memory this takes is memory their runs meet fresh."""
    want = min(need, max(0.0, available_gib() - keep_free_gib)) if gib is None else gib
    chunks: list[mmap.mmap] = []
    t0 = time.monotonic()
    try:
        for _ in range(int(want)):
            m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # one write per page is what makes the kernel (and the hypervisor under it) back the page
            m[::PAGE] = bytes(GIB // PAGE)
            chunks.append(m)
    finally:
        touched = len(chunks)
        for m in chunks:
            m.close()
    return {"gib": touched, "seconds": round(time.monotonic() - t0, 2)}


def effect(rows: list[dict[str, Any]], heap: int) -> dict[str, Any] | None:
    """What warming changed in this run: the first two migrations of a fresh ``heap`` MB workload
    before the guest memory was touched (rows marked ``before guest-memory warm-up``) beside the
    first two after it (the benchmark's own warm-up pair at that heap), and the measured median."""

    def blackouts(prefix: str) -> list[float]:
        return [
            r["blackout_s"]
            for r in rows
            if r["heap_mb"] == heap and r["method"].startswith(prefix) and r["blackout_s"] is not None
        ]

    before, after = blackouts(BEFORE), blackouts("warm-up ")
    if not before or not after:
        return None
    measured = [
        r["blackout_s"]
        for r in rows
        if r["heap_mb"] == heap
        and r["method"] == "stop-copy/stream"
        and not r["warmup"]
        and r["blackout_s"] is not None
    ]
    b, a = sum(before) / len(before), sum(after) / len(after)
    return {
        "heap_mb": heap,
        "before_s": before,
        "after_s": after,
        "before_over_after": round(b / a, 3) if a else None,
        "median_after_s": statistics.median(measured) if measured else None,
    }


def describe(e: dict[str, Any]) -> str:
    median = f"; stop-copy/stream's measured median {e['median_after_s']} s" if e["median_after_s"] else ""
    return (
        f"guest memory warm-up's effect at {e['heap_mb']} MB: the first two stop-copy/stream blackouts "
        f"{', '.join(map(str, e['before_s']))} s before it, {', '.join(map(str, e['after_s']))} s after it "
        f"(before/after {e['before_over_after']}){median}"
    )
