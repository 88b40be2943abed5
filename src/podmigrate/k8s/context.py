"""What every Kubernetes phase gets (``Ctx``), and the record kept in the resource's status.

Neighbours: ``k8s.validate`` and ``k8s.phases`` take a ``Ctx``; ``k8s.controller`` makes one per
PodLiveMigration and runs it with ``engine.runner``; ``k8s.operator`` builds it from kopf's calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmigrate.engine.record import RunRecord
from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s.agents import Agents, Config
from podmigrate.k8s.statuswriter import StatusWriter

INSTANCE = "podmigrate.io/instance"
LOCK = "podmigrate.io/migration"

Event = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)


class K8sRecord(RunRecord, total=False):
    """A PodLiveMigration's record (``status.record``); ``RunRecord`` has the runner's fields."""

    spec: dict[str, Any]  # the validated spec the migration started with, whatever edits come later
    started: float
    owner: str  # the operator process running it: host/pid/random
    source: str  # node names
    target: str
    containers: list[str]  # the containers checkpointed (the others start fresh)
    source_pod: dict[str, Any]  # metadata and spec of the source pod, to recreate or copy it
    restored: str  # the copy's pod name
    references: dict[str, str]  # container -> checkpoint image reference (by tag)
    services: dict[str, dict[str, str]]  # Service -> its selector before the migration
    isolated_at: float  # stop-copy and cold: when the Services stopped selecting the source
    frozen_at: float  # stream stop-copy and lazy: the source paused for its dump (they do not isolate)
    archives: dict[str, str]  # container -> the kubelet's checkpoint archive on the source node
    checkpointed_at: float
    images: dict[str, str]  # container -> pushed checkpoint image
    digests: dict[str, str]  # container -> manifest digest
    bytes: int  # pushed
    restore_path: str  # cri (the runtime restores the image) or runtimeclass (k8s.runtimes)
    sealed: bool  # the images are sealed for this migration (runtimeclass with the operator's key)
    restore_dirs: dict[str, str]  # runtimeclass: container -> the verified checkpoint on the target node
    transport: str  # registry (the kubelet's checkpoint as an image), stream (k8s.stream_phases), none (cold)
    stream_ports: dict[str, Any]  # stream: container -> the target relays' address and ports
    stream: dict[str, Any]  # stream: container -> dump seconds, bytes of pages and of the rest
    target_memory: dict[str, Any]  # stream: the memory warmed on the target before the freeze
    proxies: dict[str, Any]  # isolate: how long the nodes' kube-proxies took to follow (k8s.proxies)
    source_ids: dict[str, str]  # stream: the source's container ids, for ending them after a pause
    proxy_marks: dict[str, str]  # decoupled: each kube-proxy's time at the cutover, for the drain
    handover: dict[str, list[str]]  # all but cold: Service -> the operator's EndpointSlices (k8s.handover)
    handover_ports: list[list[dict[str, Any]]]  # their ports (the copy must accept on each)
    handover_endpoints: dict[str, list[dict[str, Any]]]  # each slice's endpoints as taken: the source's
    pod_ip: str  # all but cold: the copy's address, as its sandbox or the kubelet said
    copy_uid: str  # the copy pod's uid, as created or as the restore saw it serve (its endpoints' targetRef)
    serving_s: float  # all but cold: the restore's wait until the agent saw the copy serve
    cutover_at: float
    conntrack: dict[str, Any]  # cleanup: per node, the entries mapped to the source's address deleted
    blackout_s: float
    drift_s: float


class Cancelled(PodmigrateError):
    """The PodLiveMigration was deleted while it ran."""


@dataclass
class StatusStore:
    """The runner's ``RecordStore`` on Kubernetes: the resource's status, record and public fields in one patch."""

    api: k.KubeAPI
    ns: str
    name: str
    writes: StatusWriter | None = None
    deferred: Callable[[], bool] = lambda: False  # whether a write now goes to ``writes`` (k8s.statuswriter)

    def save(self, rec: K8sRecord, **status: Any) -> None:
        body = {"record": rec, **status}
        if self.writes is not None and self.deferred():
            self.writes.put(json.loads(json.dumps(body)))  # as it is now: the record changes on
            return
        if self.writes is not None:
            self.writes.flush()  # a failed one among them: this write carries the whole record again
        self.api.patch(k.migrations(self.ns, self.name, status=True), {"status": body})


@dataclass
class Ctx:
    api: k.KubeAPI
    agents: Agents
    config: Config
    ns: str
    name: str
    spec: dict[str, Any]
    rec: K8sRecord
    event: Event
    on_phase: Callable[[str, float], None] = lambda _p, _s: None
    _writes: StatusWriter | None = field(default=None, init=False, repr=False)

    @property
    def writes(self) -> StatusWriter:
        if self._writes is None:
            self._writes = StatusWriter(self.api, k.migrations(self.ns, self.name, status=True))
        return self._writes

    @property
    def store(self) -> StatusStore:
        return StatusStore(self.api, self.ns, self.name, self.writes, self.in_blackout)

    def in_blackout(self) -> bool:
        """The source frozen or out of its Services, the copy not yet in them: the status is written
        off this path (``k8s.statuswriter``)."""
        rec = self.rec
        stopped = "frozen_at" in rec or "isolated_at" in rec
        return rec.get("status") == "running" and stopped and "cutover_at" not in rec

    def flush(self) -> None:
        """Every status write made: before the API client closes."""
        if self._writes is not None:
            self._writes.flush()

    def save(self, **public: Any) -> None:
        """Write the record and the public status fields in one status patch."""
        self.store.save(self.rec, **public)

    def plm(self) -> dict[str, Any] | None:
        return self.api.get(k.migrations(self.ns, self.name))

    def check_cancelled(self) -> None:
        if self.in_blackout():  # no read inside it: the last status write's answer says
            if self.writes.deleting:
                raise Cancelled(f"PodLiveMigration {self.name} was deleted while it ran")
            return
        obj = self.plm()
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            raise Cancelled(f"PodLiveMigration {self.name} was deleted while it ran")
