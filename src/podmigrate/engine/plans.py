"""The plan table: which phases a migration runs, chosen by (scope, mode, transport).

This table is the table of contents of every kind of migration, in the lab and on Kubernetes; the
phases' code lives in ``engine.phases`` (lab) and ``k8s.phases`` (Kubernetes), the loop that runs
them, undoes them and resumes them in ``engine.runner``. The table below is generated from
``PLANS`` (``python -m podmigrate.engine.plans``); ``tests/test_plans.py`` keeps it, and the one in
docs/architecture.md, equal to the code.

<!-- plan-table -->
| scope | mode | transport | phases | committed after | a controller that died before that |
|---|---|---|---|---|---|
| container | stop-copy, decoupled | registry | validate, checkpoint, push, pull, restore, cutover, verify, cleanup | verify | rolls back |
| container | stop-copy, decoupled | stream | validate, page-server, checkpoint, transfer, restore, cutover, pages, verify, cleanup | verify | rolls back |
| container | stop-copy, decoupled | archive | validate, checkpoint, transfer, restore, cutover, verify, cleanup | verify | rolls back |
| container | lazy | stream | validate, checkpoint, transfer, restore, cutover, verify, pages, cleanup | restore | rolls back |
| container | cold | none | validate, stop, start, cutover, verify, cleanup | verify | rolls back |
| container | park | registry | validate, checkpoint, push, park, cleanup | park | rolls back |
| parked | stop-copy | registry | validate, pull, restore, cutover, verify, cleanup | verify | rolls back |
| pod | stop-copy, decoupled | archive | validate, checkpoint, transfer, restore, cutover, verify, cleanup | verify | rolls back |
| kubernetes | decoupled | registry | validate, checkpoint, package, restore, cutover, cleanup | cutover | runs on |
| kubernetes | stop-copy | registry | validate, isolate, checkpoint, package, restore, cutover, cleanup | cutover | runs on |
| kubernetes | cold | none | validate, isolate, stop, restore, cutover, cleanup | cutover | runs on |
| kubernetes | decoupled, stop-copy, lazy | stream | validate, page-server, checkpoint, restore, cutover, pages, cleanup | cutover | rolls back |
<!-- /plan-table -->

Once the phase a row names under "committed after" has succeeded, the target holds the workload:
nothing is undone any more, and a failure or a crash from there on is finished forward. Before it,
a failure undoes every phase that started, newest first. What a controller does with a migration
that a dead one left half-way is the row's resume policy: the lab rolls it back (a frozen or
network-locked source must not wait for a person), the Kubernetes operator runs it on from the
phase that was running (its phases are idempotent, and a restarted operator comes back at once),
except a streamed one, which it rolls back (the copy's page server served its one dump).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class PhaseName(StrEnum):
    VALIDATE = "validate"  # locate, check the nodes and the request; nothing changes yet
    ISOLATE = "isolate"  # Kubernetes stop-copy and cold: the Services stop sending to the source
    PAGE_SERVER = "page-server"  # stream: the target's CRIU page server, ready for the dump's pages
    CHECKPOINT = "checkpoint"  # CRIU dumps the source (frozen, or left running when decoupled)
    PUSH = "push"  # registry: the archive as an OCI checkpoint image
    PULL = "pull"  # registry: the image's layer into the target's checkpoint directory
    PACKAGE = "package"  # Kubernetes: the kubelet's archives pushed as checkpoint images
    TRANSFER = "transfer"  # the archive (or what is left of it) agent to agent
    STOP = "stop"  # cold: the source stops (its state is lost)
    START = "start"  # cold: a fresh container from the image on the target
    RESTORE = "restore"  # CRIU restores the copy on the target
    CUTOVER = "cutover"  # traffic goes to the target (a route, an nft map element, a selector)
    VERIFY = "verify"  # the copy answers with the state the source had
    PAGES = "pages"  # lazy, and a streamed restore: every page has moved into the copy
    PARK = "park"  # the image stays in the registry, and what restoring it needs (engine.parking)
    CLEANUP = "cleanup"  # the source, the archives and images go; failures are warnings


class Resume(StrEnum):
    """What a controller does with a migration that a dead controller left before its commit."""

    ROLLBACK = "rolls back"
    RERUN = "runs on"


@dataclass(frozen=True)
class Row:
    phases: tuple[PhaseName, ...]
    commit: PhaseName  # once this phase succeeded, nothing is undone: failures finish forward
    resume: Resume


# how a lab migration moves its checkpoint unless told otherwise: the library's Plan, the CLI and the
# benchmarks all take it from here (the fastest way that keeps zero drift; Kubernetes has registry only)
DEFAULT_TRANSPORT = "stream"

P = PhaseName
_LAB = Resume.ROLLBACK
_K8S = Resume.RERUN
_COPY = ("stop-copy", "decoupled")

# (scope, mode, transport) -> row. Scopes: a lab container, a lab pod (every member at once), a
# parked container's checkpoint (restored from the registry), a Kubernetes pod. Lazy always streams; cold moves no checkpoint (transport "none").
PLANS: dict[tuple[str, str, str], Row] = {
    **{
        ("container", m, "registry"): Row(
            (P.VALIDATE, P.CHECKPOINT, P.PUSH, P.PULL, P.RESTORE, P.CUTOVER, P.VERIFY, P.CLEANUP), P.VERIFY, _LAB
        )
        for m in _COPY
    },
    # memory pages flow into the target's CRIU page server during the dump; the rest of the
    # checkpoint (a few MB) follows agent to agent; the copy runs before its memory is all in (pages)
    **{
        ("container", m, "stream"): Row(
            (P.VALIDATE, P.PAGE_SERVER, P.CHECKPOINT, P.TRANSFER, P.RESTORE, P.CUTOVER, P.PAGES, P.VERIFY, P.CLEANUP),
            P.VERIFY,
            _LAB,
        )
        for m in _COPY
    },
    **{
        ("container", m, "archive"): Row(
            (P.VALIDATE, P.CHECKPOINT, P.TRANSFER, P.RESTORE, P.CUTOVER, P.VERIFY, P.CLEANUP), P.VERIFY, _LAB
        )
        for m in _COPY
    },
    # post-copy: once the copy runs on the target, the source only serves pages and dies when they
    # have all moved; the target holds the only complete copy from the restore on
    ("container", "lazy", "stream"): Row(
        (P.VALIDATE, P.CHECKPOINT, P.TRANSFER, P.RESTORE, P.CUTOVER, P.VERIFY, P.PAGES, P.CLEANUP), P.RESTORE, _LAB
    ),
    ("container", "cold", "none"): Row((P.VALIDATE, P.STOP, P.START, P.CUTOVER, P.VERIFY, P.CLEANUP), P.VERIFY, _LAB),
    # no node can take it in time: the checkpoint waits in the registry for `podmigrate restore`
    ("container", "park", "registry"): Row((P.VALIDATE, P.CHECKPOINT, P.PUSH, P.PARK, P.CLEANUP), P.PARK, _LAB),
    # a parked checkpoint restored: until its verify, a failure leaves it parked
    ("parked", "stop-copy", "registry"): Row(
        (P.VALIDATE, P.PULL, P.RESTORE, P.CUTOVER, P.VERIFY, P.CLEANUP), P.VERIFY, _LAB
    ),
    # every member dumped and restored under one lock of the pod's network namespace, so their
    # loopback connections survive; each member's archive goes agent to agent
    **{
        ("pod", m, "archive"): Row(
            (P.VALIDATE, P.CHECKPOINT, P.TRANSFER, P.RESTORE, P.CUTOVER, P.VERIFY, P.CLEANUP), P.VERIFY, _LAB
        )
        for m in _COPY
    },
    ("kubernetes", "decoupled", "registry"): Row(
        (P.VALIDATE, P.CHECKPOINT, P.PACKAGE, P.RESTORE, P.CUTOVER, P.CLEANUP), P.CUTOVER, _K8S
    ),
    # isolate first: no request reaches the source after its checkpoint (zero drift)
    ("kubernetes", "stop-copy", "registry"): Row(
        (P.VALIDATE, P.ISOLATE, P.CHECKPOINT, P.PACKAGE, P.RESTORE, P.CUTOVER, P.CLEANUP), P.CUTOVER, _K8S
    ),
    ("kubernetes", "cold", "none"): Row(
        (P.VALIDATE, P.ISOLATE, P.STOP, P.RESTORE, P.CUTOVER, P.CLEANUP), P.CUTOVER, _K8S
    ),
    # the copy's pod waits on the target (page-server) before the source is touched; its pages come
    # during the dump, the rest right after, and its waiting create restores. Rolled back, not run on,
    # when its operator died: the waiting page server took its one connection, no new dump can use it
    # (pages: the copy runs before its memory is all in, copied from those images by a local daemon)
    ("kubernetes", "decoupled", "stream"): Row(
        (P.VALIDATE, P.PAGE_SERVER, P.CHECKPOINT, P.RESTORE, P.CUTOVER, P.PAGES, P.CLEANUP), P.CUTOVER, _LAB
    ),
    # the source is paused before its dump, so nothing it answers is lost, and the Services switch
    # from it to the copy in one change: no isolate (kube-proxy syncs at most once a second, by
    # default: a second change within the blackout would wait for it)
    ("kubernetes", "stop-copy", "stream"): Row(
        (P.VALIDATE, P.PAGE_SERVER, P.CHECKPOINT, P.RESTORE, P.CUTOVER, P.PAGES, P.CLEANUP), P.CUTOVER, _LAB
    ),
    # post-copy: until the cutover no request reached the copy and the source, frozen, still holds
    # all its memory (its CRIU serves from it): killing the dump and thawing it is a rollback
    ("kubernetes", "lazy", "stream"): Row(
        (P.VALIDATE, P.PAGE_SERVER, P.CHECKPOINT, P.RESTORE, P.CUTOVER, P.PAGES, P.CLEANUP), P.CUTOVER, _LAB
    ),
}


def row(scope: str, mode: str, transport: str) -> Row:
    """The row for a migration; a combination the table lacks is a programming error upstream
    (requests are validated against ``modes``/``transports`` before any phase runs)."""
    try:
        return PLANS[(scope, mode, transport)]
    except KeyError:
        raise KeyError(f"no plan for scope {scope!r}, mode {mode!r}, transport {transport!r}") from None


def modes(scope: str) -> list[str]:
    return sorted({m for s, m, _ in PLANS if s == scope})


def transports(scope: str, mode: str) -> list[str]:
    return sorted({t for s, m, t in PLANS if s == scope and m == mode})


def markdown_table() -> str:
    """The table of PLANS as markdown, rows that differ only in mode merged."""
    merged: dict[tuple[str, str, Row], list[str]] = {}
    for (scope, mode, transport), r in PLANS.items():
        merged.setdefault((scope, transport, r), []).append(mode)
    lines = [
        "| scope | mode | transport | phases | committed after | a controller that died before that |",
        "|---|---|---|---|---|---|",
    ]
    for (scope, transport, r), ms in merged.items():
        phases = ", ".join(p.value for p in r.phases)
        lines.append(f"| {scope} | {', '.join(ms)} | {transport} | {phases} | {r.commit.value} | {r.resume.value} |")
    return "\n".join(lines)


BEGIN, END = "<!-- plan-table -->", "<!-- /plan-table -->"


def with_table(text: str) -> str:
    """``text`` with the part between the plan-table markers replaced by the current table."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"


def main(argv: list[str]) -> None:
    """Print the table; with ``--write``, rewrite it in this module's docstring and the docs."""
    if "--write" not in argv:
        print(markdown_table())
        return
    root = Path(__file__).resolve().parents[3]
    for path in (Path(__file__), root / "docs" / "architecture.md"):
        path.write_text(with_table(path.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
