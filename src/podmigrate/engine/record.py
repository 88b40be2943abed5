"""Migration records, field by field, and the lab's store of them (SQLite).

A record is written after every step, so that a controller that dies mid-migration leaves enough
behind for the next one to roll it back or finish it (``engine.runner``). ``RunRecord`` holds what
the runner itself keeps, for the lab and Kubernetes alike; ``Record`` is the lab's record
(``engine.phases`` fill it in); the Kubernetes record is ``k8s.phases.K8sRecord``. Times are epoch
seconds (floats), sizes bytes.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, NotRequired, Protocol, TypedDict, cast

# Statuses: running -> completed | rolled_back | failed; rolling_back while the undos run (a
# controller that dies then leaves it for the next one to finish the rollback).
ACTIVE = ("running", "rolling_back")
FINISHED = ("completed", "rolled_back", "failed")


class PhaseEntry(TypedDict, total=False):
    name: str
    started: float
    ended: float
    ok: bool  # finished without error (a phase after the commit that failed: False, and run past)


class Rollback(TypedDict, total=False):
    phase: str
    ok: bool
    did: str  # what the undo did, for people
    error: str  # why it failed
    at: float


class Leftover(TypedDict):
    """A copy (archive, image) a failed undo could not delete: the workload is safe; see ``gc``."""

    phase: str
    error: str


class RunRecord(TypedDict, total=False):
    """The runner's part of every record."""

    id: str  # YYYYmmdd-HHMMSS-xxxxxx (lab) or YYYYmmddHHMMSS-xxxxxx (Kubernetes): also the checkpoint's tag
    status: str  # see ACTIVE and FINISHED
    phase: str | None  # the phase running or last run
    phases: list[PhaseEntry]  # in the order they started; a phase run again replaces its entry
    done: list[str]  # phases finished (or, past the commit, given up on): a resumed run skips them
    rollbacks: list[Rollback]  # the undos, in the order they ran
    error: dict[str, Any]  # the failure, as ``PodmigrateError.to_wire()``: kind, message, hint, details
    hint: str  # what to do about a failure that was not rolled back
    leftovers: list[Leftover]
    warnings: list[str]  # what the user should know: partial checkpoints, cleanup that failed
    recovered_at: float  # when a later controller finished what a dead one left


class PlanDict(TypedDict):
    """The request as given (``engine.controller.Plan``)."""

    workload: str
    target: str
    mode: str
    transport: str
    compression: str
    tcp_established: bool
    only: tuple[str, ...] | list[str]
    probe: str | None
    probe_interval: float
    verify_timeout: float
    drain_timeout: float
    security: NotRequired[str]  # on | off (measuring only); absent in records older than the field: on
    old_paths: NotRequired[tuple[str, ...] | list[str]]  # engine.paths changes to take the old path for
    huge_pages: NotRequired[str]  # after (the default; absent in older records) | deferred


class Security(TypedDict, total=False):
    """How this migration's bytes and calls crossed, each key set by the phase that saw it happen
    (from the agent's answer or the client that was used), never up front: a key that is missing
    says that nothing crossed that way (a cold restart has no ``sealed``, a registry migration no
    ``pages``, ``agents``). Never a key."""

    sealed: bool  # the checkpoint crossed sealed with the migration's key (push, pull or upload said so)
    # memory pages that crossed outside the checkpoint: a streamed dump's into the target's page
    # server, a lazy copy's fetched from the source: "sealed relay" (transport.pagerelay, AES-256-GCM),
    # "criu tls" (CRIU's own GnuTLS; the old paths criu-tls-pages, lazy-criu-tls), "plain" (security off)
    pages: str
    controller: str  # how this controller reached the agents (client.AgentClient.channel): "unix socket + token"
    agents: str  # how the source agent's uploads reached the target agent: "mutual TLS (TLSv1.3)"


class PodPlan(TypedDict, total=False):
    name: str
    infra: str
    members: list[str]  # every container of the pod
    mac: str | None  # the pod's MAC, kept by the copy
    checkpointed: list[str]  # the members that keep their state (all, unless --only-container)
    fresh: list[dict[str, Any]]  # run specs of the others, started afresh on the target


class ProbeRec(TypedDict, total=False):
    host: str  # the service address
    port: int
    path: str | None  # HTTP path, or None for a TCP connect
    interval: float
    id: str  # the LAN agent's prober while it runs
    log: str  # where its answers were written
    records: int  # how many answers it logged
    pending_at_stop: int  # probes still in flight when it stopped (engine.phases.traffic.settle_pending)
    source_host: str  # router none: the source's address, probed until the cutover
    source_log: str  # router none: that probe's answers (engine.phases.published)


class Bytes(TypedDict, total=False):
    archive: int  # the checkpoint archive (pods: all members)
    pages: int  # memory pages streamed into a page server or pulled by a lazy copy
    pushed: int  # to the registry
    pulled: int  # from the registry
    sent: int  # agent to agent
    page_relay: dict[str, int]  # plaintext each way through the sealed page relay (pages, answers)


class CheckpointImage(TypedDict):
    reference: str
    manifest_digest: str
    layer_digest: str


class Lazy(TypedDict, total=False):
    address: str  # the source's lazy-pages server (its sealed relay's, with ``relay``)
    port: int
    relay: bool  # the pages cross through the agents' sealed relay (transport.pagerelay)
    criu_port: int  # with relay: the dump's own port, on the source's loopback (abort-lazy's way in)
    relay_bytes: dict[str, int]  # with relay, at the source: pages sent, the daemon's requests received
    times: dict[str, Any]  # podman started, frozen by us, CRIU serving pages, target's part packed; timeline
    dump_mode: str  # read: the pages stayed in the frozen tasks (lab.criu_build); splice: pinned in pipes
    lan_tx_before: int | None  # the source's LAN transmit counter when the copy started
    wake_faults: bool  # the target ran the fault waker (runtime/uffd.py)
    source_rc: int | None
    daemon_rc: int | None
    all_pages_at: float
    waker: dict[str, Any]
    # the small mappings' pages sent beside the dump: the source's state (sent, failed + error, ...),
    # bytes, mappings, read seconds, read_at, packed_at, sent_at; on the target arrived_at,
    # the restore's outcome (used, missed) and its script's start and seconds (one clock in the lab)
    prefetch: dict[str, Any]


class Cutover(TypedDict, total=False):
    router: str | None  # route | nft
    switches: list[dict[str, Any]]  # the LAN agent's answer per service address (started, ended, draining)
    switch_s: float
    drain: list[dict[str, Any]]  # decoupled with nft: how the draining ended (drained_s, open, forced)


class Record(RunRecord, total=False):
    """A lab migration."""

    workload: str  # as the user named it
    container: str  # the container on both nodes (the pod's name when scope is pod)
    container_id: str  # the source container's ID: a failed restore may leave storage under it
    scope: str  # container (default) | pod | parked (a restore from the registry)
    pod: PodPlan
    source: str | None  # node names
    target: str
    mode: str  # stop-copy | decoupled | lazy | cold
    transport: str  # registry | stream | archive (pods), none (cold)
    plan: PlanDict
    reference: str  # the checkpoint image's reference (registry transport)
    created: float
    updated: float
    controller_pid: int  # with controller_start: a dead controller with an active status means recover
    controller_start: int | None  # its start time (procs.Proc): a reused pid is not the controller
    image: str  # the container's base image
    image_id: str  # and its ID (park: the restore's target needs that very image)
    checkpoint_id: str  # a restore of a parked checkpoint: the park's id, which its seal names
    parked: dict[str, Any]  # park: where the image is and how to restore it; restore: the parked entry
    parked_for_s: float  # restore: from the park to the restore's end
    service_probe: ProbeRec | None  # park: how the service is probed, kept for the restore
    target_image: dict[str, Any]  # the target agent's answer to fetching it (validate)
    member_images: dict[str, dict[str, Any]]  # pods: the same, per member
    target_memory: dict[str, Any]  # memory warmed on the target for the restore (reserve-memory)
    service_addresses: list[str]  # the addresses that move with the workload
    keep_address: bool  # False: the copy takes an address of the target's (router none)
    copy_network: str  # what of the source's address the copy keeps (runtime.podman_cli.RESTORE_NETWORK)
    withdrawn_at: float  # a shared segment: when the source gave up its addresses, just before its freeze
    published: list[dict[str, Any]]  # then: its published ports (container_port, protocol, host_ip, host_port)
    answers_at: list[str]  # then: host:port where it answers after the cutover
    tcp: str  # why open TCP connections were not carried, when they were not
    nodes: dict[str, dict[str, Any]]  # versions, free disk and capabilities of both nodes at validate
    spec: dict[str, Any]  # cold: how to start the container afresh
    probe: ProbeRec
    state_before: dict[str, Any]  # the workload's /state before and after (stream-server workloads)
    state_after: dict[str, Any]
    page_server: dict[str, Any] | None  # stream: the target's page server (address, port, relay)
    leave_stopped: bool  # stream stop-copy: the source stays frozen (not killed) until the target serves
    freeze_started: float  # when the source stopped serving (dump or stop began)
    checkpoint_at: float  # when the dump ended
    restored_at: float
    restored_check: str  # when the copy's state and addresses were checked (engine.paths)
    first_answer_at: float
    criu: dict[str, Any]  # CRIU's statistics: dump, restore (pods: per member)
    security: Security
    old_paths: list[str]  # the engine.paths changes this migration took the old path for (plan.old_paths)
    bytes: Bytes
    checkpoint_image: CheckpointImage
    stream: dict[str, Any]  # sha256 and seconds of the agent-to-agent copy
    lazy: Lazy
    # lazy: the target's podman restore started before the freeze (runtime.speculative): state waiting,
    # used, 'gone: ...' (it died; restored after the dump), cancelled, or not used (why); podman_s, its time to the gate
    speculative: dict[str, Any]
    lazy_local: bool  # a streamed restore whose memory a local lazy-pages daemon copied in
    local_pages: dict[str, Any]  # that daemon's end: exit code, when the controller saw it, the fault waker
    cutover: Cutover
    checks: dict[str, bool]  # sha256_equal, counter_not_backwards, same_process_start
    # after a lazy restore's last page: the copy's memory collapsed back into huge pages
    # (runtime.hugepages: mode, ranges, bytes, collapsed_bytes, failed by errno, seconds) or an error
    huge_pages: dict[str, Any]
    state: str  # kept | lost
    blackout: dict[str, Any]  # engine.blackout's figures from the probe log (and at_cutover, counters)
    drift: dict[str, Any]  # counter: ticks the source ran past the checkpoint; since_checkpoint_s
    cleanup_warnings: list[str]
    # derived by engine.summary
    phase_s: dict[str, float]
    blackout_s: float
    blackout_method: str  # probe | controller
    blackout_cutover_s: float
    rss_bytes: int  # the workload's resident memory at validate
    timeline: list[list[Any]]  # the agents' spans [what, from, to] (engine.breakdown.note)
    blackout_steps: dict[str, Any]  # the blackout split into its steps (engine.breakdown.steps)
    bytes_moved: int
    throughput_mb_s: float | None


Records = list[Record]


class RecordStore(Protocol):
    """Where a controller keeps its records: SQLite in the lab (``Store``), the resource's status on
    Kubernetes (``k8s.context.StatusStore``, which also writes ``status``: the public fields)."""

    def save(self, rec: Any, **status: Any) -> None: ...


class Store:
    """The lab's records, in SQLite in the lab's state directory (safe for concurrent commands)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS migrations (id TEXT PRIMARY KEY, workload TEXT, "
                "status TEXT, phase TEXT, created REAL, updated REAL, record TEXT)"
            )

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def save(self, rec: Record, **status: Any) -> None:
        """Insert or replace ``rec``; ``status`` is for stores that show more than the record (none here)."""
        rec["updated"] = time.time()
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO migrations VALUES (?,?,?,?,?,?,?)",
                (
                    rec["id"],
                    rec["workload"],
                    rec["status"],
                    rec.get("phase"),
                    rec["created"],
                    rec["updated"],
                    json.dumps(rec, default=str),
                ),
            )

    def get(self, mid: str) -> Record | None:
        with self._db() as db:
            row = db.execute("SELECT record FROM migrations WHERE id=?", (mid,)).fetchone()
        return cast(Record, json.loads(row[0])) if row else None

    def list(self, status: str | tuple[str, ...] | None = None, limit: int = 100) -> list[Record]:
        q = "SELECT record FROM migrations"
        statuses = (status,) if isinstance(status, str) else status or ()
        if statuses:
            q += f" WHERE status IN ({','.join('?' * len(statuses))})"
        q += " ORDER BY created DESC LIMIT ?"
        with self._db() as db:
            rows = db.execute(q, (*statuses, limit)).fetchall()
        return [cast(Record, json.loads(r[0])) for r in rows]

    def active(self) -> Records:
        """Migrations a controller is running or rolling back (or left so when it died)."""
        return self.list(status=ACTIVE)
