"""An evacuation's plan: which workload goes where, how, in what order and how many at once, so that
a node is empty before its deadline, soon and with little blackout (pure: no lab, no I/O).

Inputs are what the controller knows: each workload's resident memory, each target's free memory
and disk, and per way of moving (mode and transport) a linear model of its time and its blackout
(``Rate``: fixed seconds plus bytes over a rate, measured from past migrations by
``engine.rates`` or, when there are none, a default that says so). Running several at once on a
2-core machine is not free: ``slowdown[k]`` is how much longer each of ``k`` concurrent migrations
takes than it would alone (one factor, or one per mode: two CRIU dumps contend more than two
post-copy tails); the plan tries each ``k`` and keeps the best (``plan``): least lost, then the
soonest empty whose total blackout is at most ``BLACKOUT_TRADE`` times the least.

Per workload, longest first (by its least-blackout way's time: the longest jobs first keep the
lanes even): the ways it can move with its state, least blackout first, on the target with the most
memory left that holds it; the first way that ends in time is taken. A workload no target can hold,
or that no way moves in time, is *parked* (checkpointed into the registry, restorable later) if that
ends in time, else restarted cold from its image on a target (the service stays, its state does
not), else reported *lost* with the reason. "In time" is ``reserve`` (a fraction of the deadline)
before it: the rates are medians and this machine's timings are noisy. Neighbours:
``engine.evacuate`` runs a plan and re-plans when a target fails; ``engine.rates`` makes the rates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MARGIN = 256 << 20  # what a target keeps for itself beyond its copies (as engine.phases.fit)
# A notice may come sooner than announced and a failed migration needs time to be tried again: an
# empty node sooner is worth some blackout. Two lanes here: -27 % time to empty, +19-34 % median
# blackout (docs/measurements.md, issue 35); the default slowdown predicts +50 %, which this allows.
BLACKOUT_TRADE = 1.5
GB = 1 << 30


@dataclass(frozen=True)
class Workload:
    name: str
    memory: int  # resident bytes: what a restore writes
    kind: str = "container"  # or "pod" (stop-copy/archive only), "k8s" (a Kubernetes pod: stop-copy/registry)
    pod: str | None = None  # a pod's name (``name`` is the member that moving the pod is asked by)
    source: str = ""


@dataclass(frozen=True)
class Target:
    name: str
    memory_free: int
    disk_free: int


@dataclass(frozen=True)
class Rate:
    """How long one way of moving takes, and its blackout, for ``b`` bytes: fixed + b / per-second."""

    mode: str
    transport: str
    fixed_s: float
    bytes_per_s: float
    blackout_fixed_s: float
    blackout_bytes_per_s: float | None  # None: the blackout does not grow with the memory (lazy)
    basis: str  # "measured: N migrations" or "default: ..."

    @property
    def way(self) -> str:
        return f"{self.mode}/{self.transport}"

    def total(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s

    def blackout(self, nbytes: int) -> float:
        grows = nbytes / self.blackout_bytes_per_s if self.blackout_bytes_per_s else 0.0
        return self.blackout_fixed_s + grows


@dataclass
class Step:
    workload: str
    memory: int
    action: str  # migrate | park | restart (cold: state lost) | lost
    target: str | None = None
    mode: str | None = None
    transport: str | None = None
    lane: int | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    blackout_s: float = 0.0
    why: str = ""


@dataclass
class EvacuationPlan:
    deadline_s: float
    parallel: int
    reserve: float = 0.0
    steps: list[Step] = field(default_factory=list)
    considered: dict[int, float] = field(default_factory=dict)  # parallel -> predicted end

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.steps if s.action != "lost"), default=0.0)

    @property
    def total_blackout_s(self) -> float:
        return sum(s.blackout_s for s in self.steps if s.action == "migrate")

    @property
    def fits(self) -> bool:
        return all(s.action == "migrate" for s in self.steps) and self.end_s <= self.deadline_s

    def count(self, action: str) -> int:
        return sum(s.action == action for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "deadline_s": self.deadline_s,
            "parallel": self.parallel,
            "reserve": self.reserve,
            "predicted_end_s": round(self.end_s, 3),
            "total_blackout_s": round(self.total_blackout_s, 3),
            "fits": self.fits,
            "considered": {str(k): round(v, 3) for k, v in self.considered.items()},
            "steps": [asdict(s) for s in self.steps],
        }


def ways_for(w: Workload, rates: Mapping[str, Rate]) -> list[Rate]:
    """The ways ``w`` can move with its state, least blackout first (not decoupled: what the source
    changes after its checkpoint would be lost; pods: stop-copy, every member's archive)."""
    if w.kind == "k8s":  # through the kubelet's checkpoint API and a registry: the one way there
        wanted = [r for r in rates.values() if r.mode == "stop-copy" and r.transport == "registry"]
    elif w.kind == "pod":
        wanted = [r for r in rates.values() if r.mode == "stop-copy" and r.transport == "archive"]
    else:
        wanted = [r for r in rates.values() if r.mode in ("lazy", "stop-copy") and r.transport != "archive"]
    return sorted(wanted, key=lambda r: (r.blackout(w.memory), r.total(w.memory)))


Pick = Callable[[Workload], list[Rate]]  # the ways to try for a workload, in order
Factor = float | Mapping[str, float]  # a slowdown: one for all, or per mode ("*": the others)


def _f(slowdown: Factor, r: Rate) -> float:
    if isinstance(slowdown, float | int):
        return float(slowdown)
    return float(slowdown.get(r.mode, slowdown.get("*", 1.0)))


def _fastest(w: Workload, rates: Mapping[str, Rate]) -> list[Rate]:
    return sorted(ways_for(w, rates), key=lambda r: (r.total(w.memory), r.blackout(w.memory)))


def _one(
    workloads: Sequence[Workload],
    targets: Sequence[Target],
    rates: Mapping[str, Rate],
    deadline_s: float,
    parallel: int,
    slowdown: Factor,
    park: Rate | None,
    cold: Rate | None,
    reserve: float,
    pick: Pick,
    frozen_last: bool = False,
) -> EvacuationPlan:
    plan = EvacuationPlan(deadline_s, parallel, reserve)
    until = deadline_s * (1 - reserve)
    lanes = [0.0] * parallel
    room = {t.name: [t.memory_free - MARGIN, t.disk_free - MARGIN] for t in targets}
    first = {w.name: pick(w)[:1] for w in workloads}

    def order(w: Workload) -> tuple[bool, float]:
        """Longest first; with ``frozen_last``, a step frozen for most of its length (stop-copy)
        after the rest (``_lanes``)."""
        r = first[w.name][0] if first[w.name] else None
        total = r.total(w.memory) if r else 0.0
        return frozen_last and r is not None and r.blackout(w.memory) >= 0.5 * total, -total

    for w in sorted(workloads, key=order):
        lane = min(range(parallel), key=lambda i: lanes[i])
        start = lanes[lane]
        holders = [t for t, (mem, disk) in room.items() if mem >= w.memory * 1.1 and disk >= 2 * w.memory]
        step: Step | None = None
        if not holders:
            why = f"no target has {w.memory * 1.1 / GB:.2f} GiB of memory and {2 * w.memory / GB:.2f} GiB of disk left"
        else:
            target = max(holders, key=lambda t: room[t][0])
            why = "no way of moving it ends before the deadline"
            for r in pick(w):
                end = start + r.total(w.memory) * _f(slowdown, r)
                if end <= until:
                    step = Step(w.name, w.memory, "migrate", target, r.mode, r.transport, lane, start, end,
                                r.blackout(w.memory) * _f(slowdown, r))  # fmt: skip
                    room[target][0] -= int(w.memory * 1.1)
                    room[target][1] -= 2 * w.memory
                    break
        parkable = park is not None and w.kind == "container"  # a pod or a Kubernetes pod is not parked
        if (
            step is None
            and park is not None
            and parkable
            and start + park.total(w.memory) * _f(slowdown, park) <= until
        ):
            end = start + park.total(w.memory) * _f(slowdown, park)
            step = Step(w.name, w.memory, "park", None, park.mode, park.transport, lane, start, end,
                        why=f"{why}: checkpointed into the registry instead, restorable later")  # fmt: skip
        restart_on = [t for t, (mem, _) in room.items() if mem >= 64 << 20]
        if (
            step is None
            and cold is not None
            and w.kind != "pod"  # a Podman pod moves by stop-copy or decoupled only, never cold
            and restart_on
            and start + cold.total(w.memory) * _f(slowdown, cold) <= until
        ):
            end = start + cold.total(w.memory) * _f(slowdown, cold)
            target = max(restart_on, key=lambda t: room[t][0])
            lost_why = f"{why}: restarted from its image, its state lost"
            step = Step(w.name, w.memory, "restart", target, cold.mode, cold.transport, lane, start, end,
                        cold.blackout(w.memory) * _f(slowdown, cold), lost_why)  # fmt: skip
        if step is None:
            step = Step(w.name, w.memory, "lost", why=f"{why}, and no fallback ends in time either")
        else:
            lanes[lane] = step.end_s
        plan.steps.append(step)
    return plan


def _lanes(make: Callable[[bool], EvacuationPlan]) -> EvacuationPlan:
    """Longest first, or, in lanes, the steps frozen for most of their length (stop-copy) after the
    rest when that loses nothing and ends at most 10 % later: contention stretches such a step's
    blackout with it (a pod beside the 1 GB lazy move froze 3.9 s instead of 1.7, issue 35's runs),
    and at the end it overlaps only the other lanes' last tails."""
    longest = make(False)
    if longest.parallel == 1:
        return longest
    frozen_last = make(True)
    if _rank(frozen_last)[:3] <= _rank(longest)[:3] and frozen_last.end_s <= longest.end_s * 1.1:
        return frozen_last
    return longest


def _rank(p: EvacuationPlan) -> tuple[int, int, int, float, float]:
    """Fewer lost, then fewer restarted (state lost), then fewer parked, then less total blackout
    (contention lengthens every blackout), then empty sooner."""
    return (p.count("lost"), p.count("restart"), p.count("park"), round(p.total_blackout_s, 2), p.end_s)


def _search(
    ws: Sequence[Workload],
    ts: Sequence[Target],
    rates: Mapping[str, Rate],
    deadline_s: float,
    k: int,
    slowdown: Factor,
    park: Rate | None,
    cold: Rate | None,
    reserve: float,
) -> EvacuationPlan:
    """For ``k`` lanes: the greedy plan (each workload its least-blackout way that ends in time),
    or, if that loses more, the fastest ways (the most that can end in time) with the slack then
    spent on less blackout: each workload switched to a way of less blackout, the biggest savings
    first, wherever the plan still moves as much."""

    def run(pick: Pick) -> EvacuationPlan:
        return _lanes(lambda frozen_last: _one(ws, ts, rates, deadline_s, k, slowdown, park, cold, reserve, pick,
                                               frozen_last))  # fmt: skip

    greedy = run(lambda w: ways_for(w, rates))
    chosen = {w.name: ways[0] for w in ws if (ways := _fastest(w, rates))}
    best = run(lambda w: [chosen[w.name]] if w.name in chosen else [])
    if _rank(greedy)[:3] <= _rank(best)[:3]:
        return greedy
    by = {w.name: w for w in ws}
    saving = sorted(
        (
            (chosen[n].blackout(by[n].memory) - r.blackout(by[n].memory), n, r)
            for n in chosen
            for r in ways_for(by[n], rates)
        ),
        key=lambda t: -t[0],
    )
    for gain, n, r in saving:
        if gain <= 0 or r.blackout(by[n].memory) >= chosen[n].blackout(by[n].memory):
            continue
        trial = {**chosen, n: r}
        p = run(lambda w, t=trial: [t[w.name]] if w.name in t else [])  # type: ignore[misc]
        moved = {x.workload for x in best.steps if x.action == "migrate"}
        if moved <= {x.workload for x in p.steps if x.action == "migrate"} and _rank(p)[:3] <= _rank(best)[:3]:
            chosen, best = trial, p  # everything that moved still moves, with less blackout
    return best


def plan(
    workloads: Iterable[Workload],
    targets: Iterable[Target],
    rates: Mapping[str, Rate],
    deadline_s: float,
    slowdown: Mapping[int, Factor] | None = None,
    park: Rate | None = None,
    cold: Rate | None = None,
    reserve: float = 0.0,
) -> EvacuationPlan:
    """The best plan among the parallelisms in ``slowdown`` ({1: 1.0} if none): the fewest lost,
    restarted and parked (``_rank``), then the soonest empty whose total blackout is at most
    ``BLACKOUT_TRADE`` times the least; its steps in the order they start."""
    ws, ts = list(workloads), list(targets)
    slow = dict(slowdown or {1: 1.0})
    plans = [_search(ws, ts, rates, deadline_s, k, slow[k], park, cold, reserve) for k in sorted(slow)]
    best = min(plans, key=_rank)
    # as good on what is lost: the node empty sooner, if that costs at most BLACKOUT_TRADE in blackout
    bound = round(best.total_blackout_s * BLACKOUT_TRADE, 2)
    sooner = [p for p in plans if _rank(p)[:3] == _rank(best)[:3] and round(p.total_blackout_s, 2) <= bound]
    best = min(sooner, key=lambda p: (round(p.end_s, 1), p.total_blackout_s))
    best.considered = {p.parallel: p.end_s for p in plans}
    best.steps.sort(key=lambda s: (s.start_s, s.lane if s.lane is not None else 99))
    return best
