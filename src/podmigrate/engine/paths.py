"""Fixed costs taken out of the blackout (issue 14) or out of a migration's length (issue 35), each of
which can be put back to measure it.

Every change here moved work from inside the blackout to before the freeze or after the copy's
first answer, or out of the migration altogether. A migration whose plan names some of them
(``Plan.old_paths``: ``podmigrate migrate --old-paths NAME,...`` or ``all``) takes the old path for
those, and its record lists the ones it took (``old_paths``), so that ``podmigrate bench engine
--old-paths NAME`` measures a change alone, interleaved with the new path in one run. It belongs to
that one migration: any other migration, in this process or on this lab, keeps the new paths. It
exists for measuring only; the new paths are the product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from podmigrate.errors import UsageError

if TYPE_CHECKING:
    from podmigrate.engine.record import Record

CHANGES = {
    "restore-image-check": "the target's restore no longer asks podman whether the image is there first "
    "(validate made sure of it before the freeze)",
    "criu-tls-pages": "a sealed migration's streamed pages cross in CRIU's own TLS (GnuTLS, 16 KB records "
    "inside the freeze) instead of the agents' sealed relay (transport.pagerelay)",
    "lazy-criu-tls": "a sealed lazy migration's pages cross in CRIU's own TLS between the target's lazy-pages "
    "daemon and the source's dump instead of the agents' sealed relay (transport.pagerelay; CRIU in the clear "
    "on each node's loopback)",
    "eager-restore": "a streamed dump's restore reads the whole memory out of the images before the copy runs, "
    "instead of a local lazy-pages daemon copying it in while the copy already serves",
    "lazy-prefetch": "a lazy dump leaves every lazy-able page to be fetched on its first touch, instead of "
    "the smallest mappings' pages, read from the frozen source, arriving beside the restore and made "
    "present before CRIU restores the tasks (agent.node_prefetch)",
    "iptables-network-lock": "CRIU locks the container's network during a dump with iptables-restore (and a "
    "restore unlocks it with five more processes, inside the blackout) instead of nftables in CRIU's "
    "own process (lab.image's CRIU configuration)",
    "restore-after-dump": "a lazy or streamed stop-copy migration's target runs podman's whole restore once "
    "the dump has arrived, instead of podman's and runc's part before CRIU (their starts, podman's database, "
    "storage, network, conmon, runc's checks, cgroups and mounts) running before the source is frozen and "
    "waiting at a gate in front of CRIU for the real images (runtime.speculative)",
    "prefetch-wait-at-pre-restore": "a lazy restore waits for a prefetch still on its way at CRIU's pre-restore "
    "step, instead of at post-setup-namespaces, the last step before a restored task reads its pagemap "
    "(CRIU restores the namespaces meanwhile)",
    "lazy-dump-splice": "a lazy dump pins every page into pipes inside the freeze (CRIU's own way: the parasite's "
    "vmsplice, 1024 pages a pipe) instead of leaving the pages in the frozen tasks, read with process_vm_readv "
    "when the target asks (lab.criu_build's patch; the step of a lazy dump that grew with the heap)",
    "small-pages-after-lazy-restore": "a copy whose memory a lazy-pages daemon filled (userfaultfd, 4 KB at a "
    "time) keeps the small pages until khugepaged merges them (minutes), instead of being collapsed back into "
    "the huge pages it had once its last page is in (runtime.hugepages): its next freeze walks 512 times as many "
    "page-table entries. Interleaved runs confound it (each run dumps the heap the run before restored): compare "
    "whole runs",
    "sha256-of-sealed-streams": "a sealed upload (a stop-copy's archive, a lazy one's archive and its prefetch) is "
    "also hashed with SHA-256 by its sender and its receiver, the commit comparing the two, instead of the commit "
    "accepting what the seal proved: every frame authenticated, through the final one (transport.stream)",
    "restored-check-before-cutover": "the restored copy's state and addresses are checked after its first "
    "answer, not between the restore and the route switch",
    "huge-pages-inside-migration": "the migration waits, in its pages phase, until the copy's memory is back in "
    "huge pages (0.1-1.6 s here), instead of leaving that to the target agent's background (agent.collapses): "
    "not inside the blackout either way, but inside what an evacuation waits for",
}


def old(rec: Record, change: str) -> bool:
    """Whether the migration of ``rec`` takes the old path for ``change`` (its plan asked for it);
    one it takes is added to the record's ``old_paths``, from the moment it is taken."""
    plan = rec.get("plan")
    wanted = set(plan.get("old_paths") or ()) if plan else set()
    if change not in wanted and "all" not in wanted:
        return False
    taken = rec.setdefault("old_paths", [])
    if change not in taken:
        taken.append(change)
    return True


def parse(value: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in value.split(",") if x.strip())
    unknown = sorted(set(names) - set(CHANGES) - {"all"})
    if unknown:
        raise UsageError(f"no such change: {', '.join(unknown)}", hint=f"the changes: {', '.join(CHANGES)}, all")
    return names
