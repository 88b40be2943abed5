"""One PodLiveMigration: ordered phases with rollbacks, the record kept in the resource's status.

The lab controller's design (``engine.controller``) with Kubernetes backends: the node agent drives the
kubelet's Checkpoint API and pushes the checkpoint image; the kubelet and CRI-O restore a pod whose image
is that checkpoint image; the cutover is one write of each Service's selector. Phases per mode::

    decoupled  validate -> checkpoint -> package -> restore -> cutover -> cleanup
    stop-copy  validate -> isolate -> checkpoint -> package -> restore -> cutover -> cleanup
    cold       validate -> isolate -> stop -> restore (fresh) -> cutover -> cleanup

``isolate`` takes the source out of its Services (their selectors then match no pod), so in stop-copy no
request reaches the source after its checkpoint (zero drift; the price is a blackout until cutover).
``cutover`` pins each Service's selector to the restored pod with the ``podmigrate.io/instance`` label:
one API write per Service, after which exactly one pod serves. ``cleanup`` is the point of no return:
it deletes the source pod, the archives and the registry tags; its failures are warnings.

The record (``status.record``) is written after every step, so a restarted operator resumes: phases
marked done are skipped, the one that was running is run again (each ``do`` is idempotent). If a phase
fails, or the resource is deleted mid-way, every phase that started is undone, newest first, and the
source pod keeps (or gets back) its place: ``RolledBack``; ``Failed`` when an undo failed too, or the
spec was invalid.
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from podmigrate.errors import AgentError, PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s.crd import SpecError, short_name, validate_spec

INSTANCE = "podmigrate.io/instance"
LOCK = "podmigrate.io/migration"
AGENT_LABELS = "app.kubernetes.io/name=podmigrate-agent"
PUBLIC_PHASE = {
    "validate": "Pending",
    "isolate": "Checkpointing",
    "stop": "Checkpointing",
    "checkpoint": "Checkpointing",
    "package": "Transferring",
    "restore": "Restoring",
    "cutover": "CuttingOver",
    "cleanup": "CuttingOver",
}
# pod states from which a restore will not recover by waiting
FATAL_WAITING = ("ErrImagePull", "ImagePullBackOff", "CreateContainerError", "CrashLoopBackOff", "InvalidImageName")

FINISHED = ("completed", "rolled_back", "failed")
# who runs a migration: a container restart keeps the hostname and PID 1, so a random token per process
OWNER = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"  # record statuses that are never run again

Record = dict[str, Any]
Event = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)


class Cancelled(PodmigrateError):
    """The PodLiveMigration was deleted while it ran."""


@dataclass
class Config:
    registry: str = "registry.podmigrate-system.svc:5000/checkpoints"
    agent_namespace: str = "podmigrate-system"
    agent_token: str = ""
    agent_port: int = 7070
    poll_s: float = 0.5


@dataclass
class Agents:
    """Finds the node agent (DaemonSet pod) on a node and calls it."""

    api: k.KubeAPI
    config: Config
    clients: dict[str, httpx.Client] = field(default_factory=dict)

    def url(self, node: str) -> str:
        for pod in self.api.list(
            k.pods(self.config.agent_namespace), label_selector=AGENT_LABELS, field_selector=f"spec.nodeName={node}"
        ):
            if (pod.get("spec") or {}).get("nodeName") != node or not k.pod_ready(pod):
                continue  # field selectors are a server courtesy: check again
            port = self.config.agent_port
            for c in pod["spec"].get("containers", []):
                for p in c.get("ports") or []:
                    if p.get("name") == "agent":
                        port = int(p["containerPort"])
            return f"http://{pod['status']['podIP']}:{port}"
        raise AgentError(
            f"no ready podmigrate agent on node {node!r} (namespace {self.config.agent_namespace})",
            hint="is the podmigrate-agent DaemonSet scheduled there? check taints and tolerations",
            details={"node": node},
        )

    def call(self, node: str, path: str, body: dict[str, Any], timeout: float = 900.0) -> Any:
        url = self.url(node)
        if url not in self.clients:
            self.clients[url] = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {self.config.agent_token}"}, timeout=timeout
            )
        try:
            resp = self.clients[url].post(path, json=body)
        except httpx.TransportError as e:
            raise AgentError(f"agent on {node} unreachable at {url}: {e}", details={"node": node}) from e
        data = resp.json()
        if resp.status_code != 200:
            raise PodmigrateError.from_wire(data.get("error") or {"message": str(data)})
        return data

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


@dataclass
class Ctx:
    api: k.KubeAPI
    agents: Agents
    config: Config
    ns: str
    name: str
    spec: dict[str, Any]
    rec: Record
    event: Event
    on_phase: Callable[[str, float], None] = lambda _p, _s: None

    def save(self, **public: Any) -> None:
        """Write the record and the public status fields in one status patch."""
        status = {"record": self.rec, **public}
        self.api.patch(k.migrations(self.ns, self.name, status=True), {"status": status})

    def plm(self) -> dict[str, Any] | None:
        return self.api.get(k.migrations(self.ns, self.name))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------- phases
def validate(ctx: Ctx) -> None:
    rec, spec = ctx.rec, ctx.spec
    pod = ctx.api.get(k.pods(ctx.ns, spec["podName"]))
    if pod is None:
        raise SpecError(f"spec.podName: there is no pod {spec['podName']!r} in namespace {ctx.ns!r}")
    meta = pod["metadata"]
    holder = (meta.get("annotations") or {}).get(LOCK)
    if holder and holder != ctx.name and _active(ctx, holder):
        raise SpecError(f"pod {spec['podName']!r} is already being migrated by PodLiveMigration {holder!r}")
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            raise SpecError(
                f"pod {spec['podName']!r} is managed by {owner['kind']} {owner['name']!r}, which would recreate it "
                "when the source is deleted and fight over the restored copy",
                hint="migrate bare pods (or orphan the pod first: remove its ownerReferences)",
            )
    source = (pod.get("spec") or {}).get("nodeName")
    if not k.pod_ready(pod) or not source:
        raise SpecError(f"pod {spec['podName']!r} is not running and ready; only a running pod can be migrated")
    names = [c["name"] for c in pod["spec"]["containers"]]
    wanted = spec.get("containers") or ([] if spec["mode"] == "cold" else names)
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SpecError(
            f"spec.containers: pod {spec['podName']!r} has no container {', '.join(unknown)}; it has {names}"
        )
    if spec["mode"] != "cold" and len(wanted) < len(names):
        ctx.event(
            "Warning",
            "PartialCheckpoint",
            f"only {wanted} are checkpointed; {sorted(set(names) - set(wanted))} start fresh, and loopback "
            "connections between them are severed",
        )
    rec["source"] = source
    rec.setdefault("target", _pick_target(ctx, source, pod))
    rec["containers"] = wanted
    rec["source_pod"] = _clean_copy(pod, ctx.ns)
    rec.setdefault("id", f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}")
    rec["restored"] = f"{short_name(spec['podName'])}-m{rec['id'][-6:]}"
    base = spec.get("registry") or ctx.config.registry
    rec["references"] = {c: f"{base}/{ctx.ns}-{short_name(spec['podName'])}-{c}:{rec['id']}".lower() for c in wanted}
    rec["services"] = _services(ctx, pod)
    if not rec["services"]:
        ctx.event("Warning", "NoService", "no Service selects the pod: nothing to switch at cutover")
    _warn_volumes(ctx, pod)
    rec["spec"] = spec  # from here on the spec the migration started with, whatever edits come later
    ctx.api.patch(k.pods(ctx.ns, spec["podName"]), {"metadata": {"annotations": {LOCK: ctx.name}}})


def _warn_volumes(ctx: Ctx, pod: dict[str, Any]) -> None:
    """A checkpoint holds the processes and their root file system, not their volumes."""
    for v in (pod.get("spec") or {}).get("volumes") or []:
        if "emptyDir" in v:
            what = "its contents are not moved: the copy starts with an empty directory"
        elif "persistentVolumeClaim" in v:
            what = "the target must be able to attach it while the source still holds it (ReadWriteOnce cannot)"
        elif "hostPath" in v:
            what = "it points at the target node's files, not the source's"
        else:
            continue
        ctx.event("Warning", "Volume", f"volume {v['name']!r}: {what}")


def _active(ctx: Ctx, other: str) -> bool:
    obj = ctx.api.get(k.migrations(ctx.ns, other))
    return bool(obj) and (obj or {}).get("status", {}).get("phase") not in ("Completed", "Failed", "RolledBack")


def _unfit(node: dict[str, Any], pod: dict[str, Any]) -> str | None:
    """Why the kubelet would refuse the copy on ``node`` (the copy is pinned: no scheduler checks it)."""
    labels = node["metadata"].get("labels") or {}
    for key, value in ((pod.get("spec") or {}).get("nodeSelector") or {}).items():
        if key != "kubernetes.io/hostname" and labels.get(key) != value:
            return f"it lacks the pod's nodeSelector label {key}={value}"
    tolerated = {t.get("key") for t in (pod.get("spec") or {}).get("tolerations") or []}
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoExecute", "NoSchedule") and taint.get("key") not in tolerated | {None}:
            return f"the pod does not tolerate its taint {taint['key']}:{taint['effect']}"
    return None


def _pick_target(ctx: Ctx, source: str, pod: dict[str, Any]) -> str:
    spec = ctx.spec
    if spec.get("targetNode"):
        node = ctx.api.get(k.nodes(spec["targetNode"]))
        if node is None:
            raise SpecError(f"spec.targetNode: there is no node {spec['targetNode']!r}")
        if spec["targetNode"] == source:
            raise SpecError(f"spec.targetNode: the pod already runs on {source!r}; choose another node")
        if not k.node_ready(node):
            raise SpecError(f"spec.targetNode: node {spec['targetNode']!r} is not Ready or is cordoned")
        if why := _unfit(node, pod):
            raise SpecError(f"spec.targetNode: the copy cannot run on {spec['targetNode']!r}: {why}")
        return str(spec["targetNode"])
    want = spec.get("targetNodeSelector") or {}
    candidates = sorted(
        n["metadata"]["name"]
        for n in ctx.api.list(k.nodes())
        if n["metadata"]["name"] != source
        and k.node_ready(n)
        and _unfit(n, pod) is None
        and all((n["metadata"].get("labels") or {}).get(a) == b for a, b in want.items())
    )
    if not candidates:
        raise SpecError(f"no Ready node other than {source!r} matches targetNodeSelector {want}")
    return str(candidates[0])


def _services(ctx: Ctx, pod: dict[str, Any]) -> dict[str, dict[str, str]]:
    labels = pod["metadata"].get("labels") or {}
    if ctx.spec.get("service"):
        svc = ctx.api.get(k.services(ctx.ns, ctx.spec["service"]))
        if svc is None:
            raise SpecError(f"spec.service: there is no Service {ctx.spec['service']!r} in {ctx.ns!r}")
        sel = (svc.get("spec") or {}).get("selector") or {}
        if not k.selects(sel, labels):
            raise SpecError(
                f"spec.service: Service {ctx.spec['service']!r} does not select pod {pod['metadata']['name']!r}"
            )
        return {ctx.spec["service"]: sel}
    return {
        s["metadata"]["name"]: s["spec"]["selector"]
        for s in ctx.api.list(k.services(ctx.ns))
        if k.selects((s.get("spec") or {}).get("selector") or {}, labels)
    }


def _clean_copy(pod: dict[str, Any], ns: str) -> dict[str, Any]:
    meta = pod["metadata"]
    return {
        "metadata": {
            "name": meta["name"],
            "namespace": ns,
            "labels": meta.get("labels") or {},
            "annotations": {a: v for a, v in (meta.get("annotations") or {}).items() if a != LOCK},
        },
        "spec": pod["spec"],
    }


def _set_selectors(ctx: Ctx, instance: str | None) -> None:
    """Each Service back to its recorded selector, plus ``instance`` (or without it, for None)."""
    for svc, original in ctx.rec["services"].items():
        sel: dict[str, Any] = dict(original)
        sel[INSTANCE] = instance if instance is not None else original.get(INSTANCE)
        try:
            ctx.api.patch(k.services(ctx.ns, svc), {"spec": {"selector": sel}})
        except k.KubeError as e:
            if e.status != 404 or instance is not None:
                raise
            # restoring a selector: a Service someone deleted meanwhile has nothing to restore


def isolate(ctx: Ctx) -> None:
    _set_selectors(ctx, f"isolated-{ctx.rec['id']}")  # no pod carries it: the Services go empty
    ctx.rec["isolated_at"] = time.time()
    _wait_unserved(ctx)


def _wait_unserved(ctx: Ctx, timeout: float = 10.0) -> None:
    """Wait until no EndpointSlice of the Services lists the source as ready: kube-proxy (or Cilium)
    follows the slices, so only then does no new request reach the source. Connections already open
    to it stay open; a stop-copy checkpoint sees their last requests."""
    source = ctx.spec["podName"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        serving = []
        for svc in ctx.rec["services"]:
            try:
                slices = ctx.api.list(
                    f"/apis/discovery.k8s.io/v1/namespaces/{ctx.ns}/endpointslices",
                    label_selector=f"kubernetes.io/service-name={svc}",
                )
            except k.KubeError as e:
                if e.status == 404:
                    return  # no EndpointSlice API to watch: the selector write is all there is
                raise
            serving += [
                svc
                for sl in slices
                if (sl.get("metadata", {}).get("labels") or {}).get("kubernetes.io/service-name") == svc
                for ep in sl.get("endpoints") or []
                if (ep.get("targetRef") or {}).get("name") == source and (ep.get("conditions") or {}).get("ready")
            ]
        if not serving:
            return
        time.sleep(ctx.config.poll_s)
    ctx.event("Warning", "StillServing", f"{source} still listed in {sorted(set(serving))} after {timeout:.0f} s")


def undo_selectors(ctx: Ctx) -> str:
    _set_selectors(ctx, None)
    return f"restored the selectors of {sorted(ctx.rec['services'])}"


def stop(ctx: Ctx) -> None:
    ctx.api.delete(k.pods(ctx.ns, ctx.spec["podName"]))
    _wait_gone(ctx, ctx.spec["podName"])


def undo_stop(ctx: Ctx) -> str:
    src = ctx.rec["source_pod"]
    if ctx.api.get(k.pods(ctx.ns, src["metadata"]["name"])) is None:
        ctx.api.create(k.pods(ctx.ns), _pod(src, src["metadata"]["name"], ctx.rec["source"], {}))
    _wait_ready(ctx, src["metadata"]["name"], ctx.spec["timeouts"]["restoreSeconds"], cancellable=False)
    return f"started {src['metadata']['name']} again on {ctx.rec['source']} (fresh: a cold restart keeps no state)"


def checkpoint(ctx: Ctx) -> None:
    out = ctx.agents.call(
        ctx.rec["source"],
        "/v1/checkpoints",
        {
            "namespace": ctx.ns,
            "pod": ctx.spec["podName"],
            "containers": ctx.rec["containers"],
            "checkpoint_id": ctx.rec["id"],
            "timeout": ctx.spec["timeouts"]["checkpointSeconds"],
        },
    )
    ctx.rec["archives"] = {c: a["path"] for c, a in out["archives"].items()}
    ctx.rec["checkpointed_at"] = time.time()


def undo_checkpoint(ctx: Ctx) -> str:
    body = {"checkpoint_id": ctx.rec["id"], "containers": ctx.rec["containers"]}
    out = ctx.agents.call(ctx.rec["source"], "/v1/archives/delete", body)
    return f"deleted archives {sorted(p for p, was in out['deleted'].items() if was)}"


def package(ctx: Ctx) -> None:
    out = ctx.agents.call(
        ctx.rec["source"],
        "/v1/images",
        {
            "namespace": ctx.ns,
            "pod": ctx.spec["podName"],
            "archives": ctx.rec["archives"],
            "references": ctx.rec["references"],
            "compression": ctx.spec["compression"],
        },
    )
    ctx.rec["images"] = {c: i["reference"] for c, i in out["images"].items()}
    ctx.rec["digests"] = {c: i["manifest_digest"] for c, i in out["images"].items()}
    ctx.rec["bytes"] = sum(int(i["bytes"]) for i in out["images"].values())


def undo_package(ctx: Ctx) -> str:
    undo_checkpoint(ctx)  # archives are deleted after a push; a failed push leaves them
    refs = list(ctx.rec["references"].values())
    ctx.agents.call(ctx.rec["source"], "/v1/images/delete", {"references": refs})
    return f"deleted checkpoint images {refs}"


def _pod(src: dict[str, Any], name: str, node: str, images: dict[str, str], migration: str = "") -> dict[str, Any]:
    spec = copy.deepcopy(src["spec"])
    # ephemeral containers cannot be set on create; nodeName is set below
    for key in ("nodeName", "ephemeralContainers"):
        spec.pop(key, None)
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required:  # terms that pin the pod to its old node by name would make the kubelet refuse the copy
        for term in required.get("nodeSelectorTerms", []):
            term["matchExpressions"] = [
                e for e in term.get("matchExpressions", []) if e.get("key") != "kubernetes.io/hostname"
            ]
            term.pop("matchFields", None)
    if "nodeSelector" in spec:  # a selector pinned to the source's hostname would make the kubelet refuse it
        spec["nodeSelector"].pop("kubernetes.io/hostname", None)
    spec["nodeName"] = node
    for c in spec["containers"]:
        if c["name"] in images:
            c["image"] = images[c["name"]]
            c["imagePullPolicy"] = "IfNotPresent"
    annotations = dict(src["metadata"].get("annotations") or {})
    if migration:
        annotations["podmigrate.io/restored-by"] = migration
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": src["metadata"]["namespace"],
            "labels": {**src["metadata"]["labels"], INSTANCE: name},
            "annotations": annotations,
        },
        "spec": spec,
    }


def restore(ctx: Ctx) -> None:
    rec = ctx.rec
    if "isolated_at" not in rec:
        # make-before-break: pin the Services to the source first, or the copy would join them (and two
        # pods serve) as soon as it is ready, before the cutover chose it
        src = ctx.spec["podName"]
        ctx.api.patch(k.pods(ctx.ns, src), {"metadata": {"labels": {INSTANCE: src}}})
        _set_selectors(ctx, src)
    if ctx.api.get(k.pods(ctx.ns, rec["restored"])) is None:  # resumed: it may exist already
        images = rec.get("images") or {}
        ctx.api.create(k.pods(ctx.ns), _pod(rec["source_pod"], rec["restored"], rec["target"], images, ctx.name))
    _wait_ready(ctx, rec["restored"], ctx.spec["timeouts"]["restoreSeconds"])


def undo_restore(ctx: Ctx) -> str:
    gone = ctx.api.delete(k.pods(ctx.ns, str(ctx.rec["restored"])))
    if "isolated_at" not in ctx.rec:
        _set_selectors(ctx, None)
    return f"deleted pod {ctx.rec['restored']}" if gone else f"pod {ctx.rec['restored']} was not there"


def _wait_ready(ctx: Ctx, name: str, timeout: float, cancellable: bool = True) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        pod = ctx.api.get(k.pods(ctx.ns, name))
        if pod is None:  # every caller created it just before
            raise PodmigrateError(
                f"pod {name} vanished while it started (deleted, or its node failed)",
                hint="kubectl get events; check the target node",
            )
        if k.pod_ready(pod):
            return
        st = pod.get("status") or {}
        if st.get("phase") == "Failed":
            raise PodmigrateError(
                f"pod {name} failed on {pod['spec'].get('nodeName')}: {st.get('reason')} {st.get('message', '')}",
                hint="kubectl describe pod; a kubelet admission reason (NodeAffinity, OutOfcpu...) means the node "
                "does not fit; a restore error is in CRI-O's log (CPU features and CRIU versions must match)",
            )
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in FATAL_WAITING:
                raise PodmigrateError(
                    f"pod {name}: container {cs['name']} {waiting['reason']}: {waiting.get('message', '')}",
                    hint="check that the node can pull from the registry and restore (kubectl describe pod)",
                )
            last = waiting.get("reason") or last
        _check_cancelled(ctx)
        time.sleep(ctx.config.poll_s)
    raise PodmigrateError(
        f"pod {name} not ready after {timeout:.0f} s" + (f" (last: {last})" if last else ""),
        hint="raise spec.timeouts.restoreSeconds for big heaps, or check the target node",
    )


def _wait_gone(ctx: Ctx, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while ctx.api.get(k.pods(ctx.ns, name)) is not None:
        if time.monotonic() > deadline:
            raise PodmigrateError(f"pod {name} still exists {timeout:.0f} s after its deletion")
        time.sleep(ctx.config.poll_s)


def cutover(ctx: Ctx) -> None:
    ctx.api.patch(k.pods(ctx.ns, ctx.rec["restored"]), {"metadata": {"labels": {INSTANCE: ctx.rec["restored"]}}})
    _set_selectors(ctx, ctx.rec["restored"])
    ctx.rec["cutover_at"] = time.time()


def cleanup(ctx: Ctx) -> None:
    rec = ctx.rec
    warnings: list[str] = []
    steps: list[tuple[str, Callable[[], Any]]] = []
    if ctx.spec["mode"] != "cold":
        steps.append(("delete source pod", lambda: ctx.api.delete(k.pods(ctx.ns, ctx.spec["podName"]))))
    # with the source gone the Services' own selectors pick the copy alone: give them back unpinned
    steps.append(("restore the Services' selectors", lambda: _set_selectors(ctx, None)))
    if rec.get("references"):
        steps.append(
            (
                "delete checkpoint images",
                lambda: ctx.agents.call(
                    rec["source"], "/v1/images/delete", {"references": list(rec["references"].values())}
                ),
            )
        )
    if rec.get("references"):
        steps.append(("delete archives", lambda: undo_checkpoint(ctx)))
    for what, fn in steps:
        try:
            fn()
        except PodmigrateError as e:
            warnings.append(f"{what}: {e.message}")
    rec["warnings"] = rec.get("warnings", []) + warnings


@dataclass(frozen=True)
class Phase:
    name: str
    do: Callable[[Ctx], None]
    undo: Callable[[Ctx], str] | None = None
    artifact: bool = False  # its undo only deletes copies: failing leaves a leftover, the pod is safe


VALIDATE = Phase("validate", validate)
ISOLATE = Phase("isolate", isolate, undo_selectors)
STOP = Phase("stop", stop, undo_stop)
CHECKPOINT = Phase("checkpoint", checkpoint, undo_checkpoint, artifact=True)
PACKAGE = Phase("package", package, undo_package, artifact=True)
RESTORE = Phase("restore", restore, undo_restore)
CUTOVER = Phase("cutover", cutover, undo_selectors)
CLEANUP = Phase("cleanup", cleanup)


def phases_for(mode: str) -> list[Phase]:
    if mode == "cold":
        return [VALIDATE, ISOLATE, STOP, RESTORE, CUTOVER, CLEANUP]
    if mode == "stop-copy":
        return [VALIDATE, ISOLATE, CHECKPOINT, PACKAGE, RESTORE, CUTOVER, CLEANUP]
    return [VALIDATE, CHECKPOINT, PACKAGE, RESTORE, CUTOVER, CLEANUP]


# ------------------------------------------------------------------------------------------ running
def _check_cancelled(ctx: Ctx) -> None:
    obj = ctx.plm()
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        raise Cancelled(f"PodLiveMigration {ctx.name} was deleted while it ran")


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message[:1000],
        "lastTransitionTime": _now(),
    }


def _timings(rec: Record) -> dict[str, float]:
    return {p["name"]: round(p["ended"] - p["started"], 3) for p in rec["phases"] if p.get("ended")}


def run(ctx: Ctx, stop_after: str | None = None) -> Record:
    """Run (or resume) the migration to a terminal phase (or only up to ``stop_after``)."""
    rec = ctx.rec
    if rec.get("status") in FINISHED:
        return rec
    if rec.get("status") == "rolling_back":  # the operator died while it rolled back: finish that
        ctx.spec = rec.get("spec") or validate_spec(ctx.spec)
        return _fail(ctx, PodmigrateError(rec.get("error", {}).get("message", "interrupted rollback")), resumed=True)
    rec.setdefault("status", "running")
    rec.setdefault("phases", [])
    rec.setdefault("done", [])
    rec.setdefault("rollbacks", [])
    me = OWNER
    if not rec["phases"]:
        rec["started"], rec["owner"] = time.time(), me
        ctx.save(phase="Pending", startedAt=_now(), message="accepted")
    elif rec.get("owner") != me:  # another operator process started it and died
        ctx.event(
            "Normal",
            "Resumed",
            f"resuming after {rec['done'][-1] if rec['done'] else 'nothing'}; was {rec.get('owner')}",
        )
        rec["owner"] = me
    try:
        spec = rec.get("spec") or validate_spec(ctx.spec)
        ctx.spec = spec
        for phase in phases_for(spec["mode"]):
            if phase.name in rec["done"]:
                continue
            if phase.name != "validate":
                _check_cancelled(ctx)
            entry: dict[str, Any] = {"name": phase.name, "started": time.time()}
            rec["phases"] = [p for p in rec["phases"] if p["name"] != phase.name] + [entry]
            rec["phase"] = phase.name
            ctx.save(
                phase=PUBLIC_PHASE[phase.name],
                message=f"{phase.name} running",
                conditions=[_condition("Progressing", True, phase.name.capitalize(), f"{phase.name} running")],
            )
            phase.do(ctx)
            entry["ended"] = time.time()
            rec["done"].append(phase.name)
            took = entry["ended"] - entry["started"]
            ctx.on_phase(phase.name, took)
            ctx.event(
                "Normal", phase.name.capitalize(), f"{phase.name} done in {took:.3f} s" + _phase_note(rec, phase.name)
            )
            ctx.save(
                phase=PUBLIC_PHASE[phase.name],
                sourceNode=rec.get("source"),
                targetNode=rec.get("target"),
                phaseTimings=_timings(rec),
            )
            if phase.name == stop_after:
                return rec
    except Exception as e:
        return _fail(ctx, e)
    rec["status"] = "completed"
    blackout = rec["cutover_at"] - rec["isolated_at"] if "isolated_at" in rec else 0.0
    drift = rec["cutover_at"] - rec["checkpointed_at"] if spec["mode"] == "decoupled" else 0.0
    rec["blackout_s"], rec["drift_s"] = blackout, drift
    msg = f"moved {spec['podName']} from {rec['source']} to {rec['target']} as {rec['restored']}"
    if rec.get("warnings"):
        msg += "; cleanup left: " + "; ".join(rec["warnings"])
    ctx.event("Normal" if not rec.get("warnings") else "Warning", "Completed", msg)
    ctx.save(
        phase="Completed",
        message=msg,
        restoredPod={"name": rec["restored"], "node": rec["target"]},
        checkpointImages=rec.get("images") or {},
        phaseTimings=_timings(rec),
        blackoutSeconds=round(blackout, 3),
        driftSeconds=round(drift, 3),
        bytes=int(rec.get("bytes", 0)),
        completedAt=_now(),
        conditions=[
            _condition("Progressing", False, "Completed", msg),
            _condition("Succeeded", True, "Completed", msg),
        ],
    )
    return rec


def _phase_note(rec: Record, name: str) -> str:
    if name == "validate":
        return f": {rec['source']} -> {rec['target']}"
    if name == "package":
        return f": {rec.get('bytes', 0)} bytes pushed"
    return ""


class Transient(PodmigrateError):
    """A failure before anything changed that a retry may not meet (API or agent briefly unreachable)."""


def _fail(ctx: Ctx, e: Exception, resumed: bool = False) -> Record:
    rec = ctx.rec
    err = e if isinstance(e, PodmigrateError) else PodmigrateError(f"{type(e).__name__}: {e}")
    if isinstance(e, SpecError):
        err = PodmigrateError(str(e), hint=getattr(e, "hint", None))
    failed_in = rec.get("phase") or "validate"
    if failed_in == "validate" and not isinstance(e, SpecError) and not resumed:
        # nothing changed yet and nothing is wrong with the spec: let the operator retry later
        rec["phases"] = [p for p in rec["phases"] if p["name"] != "validate"]
        raise Transient(f"validate: {err.message}", hint=err.hint) from e
    if not resumed:
        rec["error"] = err.to_wire()
        if rec["phases"] and "ended" not in rec["phases"][-1]:
            rec["phases"][-1]["ended"] = time.time()
    if failed_in == "validate":
        rec["status"] = "failed"
        reason, message = "InvalidSpec", err.message
        _unlock(ctx)
    elif failed_in == "cleanup":  # past the point of no return: the copy serves, finish forward
        return run_cleanup_forward(ctx, err)
    else:
        ok = rollback(ctx)
        rec["status"] = "rolled_back" if ok else "failed"
        reason = "RolledBack" if ok else "RollbackFailed"
        where = rec.get("source") or "its node"
        message = f"{failed_in} failed: {err.message}; " + (
            f"rolled back, {ctx.spec.get('podName')} runs on {where}" if ok else "ROLLBACK FAILED: see status.record"
        )
        if rec.get("leftovers"):
            message += "; could not delete (run the agents' gc): " + "; ".join(rec["leftovers"])
    ctx.event("Warning", reason, message)
    phase = "RolledBack" if rec["status"] == "rolled_back" else "Failed"
    if isinstance(e, Cancelled) and ctx.plm() is None:
        return rec  # nothing left to write the outcome to
    ctx.save(
        phase=phase,
        reason=reason,
        message=message,
        phaseTimings=_timings(rec),
        completedAt=_now(),
        conditions=[_condition("Progressing", False, reason, message), _condition("Succeeded", False, reason, message)],
    )
    return rec


def run_cleanup_forward(ctx: Ctx, err: PodmigrateError) -> Record:
    ctx.rec.setdefault("warnings", []).append(f"cleanup: {err.message}")
    ctx.rec["done"].append("cleanup")
    ctx.rec["status"] = "running"
    return run(ctx)


def rollback(ctx: Ctx) -> bool:
    """Undo every phase that started, newest first, saving after each step: an operator that dies
    half-way finds ``rolling_back`` and finishes the rollback instead of going forward again."""
    rec = ctx.rec
    rec["status"] = "rolling_back"
    _save_quietly(ctx)
    by_name = {p.name: p for p in phases_for(ctx.spec.get("mode", "decoupled"))}
    ok = True
    for entry in reversed(rec["phases"]):
        phase = by_name.get(entry["name"])
        if phase is None or phase.undo is None:
            continue
        undone = {r["phase"] for r in rec["rollbacks"] if r["ok"]}
        if phase.name in undone:
            continue  # a resumed rollback: done before the operator died
        if phase.undo is undo_selectors and undone & {"isolate", "cutover"}:
            continue  # both isolate and cutover undo to the same recorded selectors
        try:
            did = phase.undo(ctx)
            rec["rollbacks"].append({"phase": phase.name, "ok": True, "did": did, "at": time.time()})
        except Exception as e:  # keep undoing the rest: each undo protects something else
            msg = e.message if isinstance(e, PodmigrateError) else str(e)
            rec["rollbacks"].append({"phase": phase.name, "ok": False, "error": msg, "at": time.time()})
            if phase.artifact:
                rec.setdefault("leftovers", []).append(f"{phase.name}: {msg}")
            else:
                ok = False
        _save_quietly(ctx)
    _unlock(ctx)
    return ok


def _save_quietly(ctx: Ctx) -> None:
    # the object may be gone (a cancelled migration); the undo itself matters more
    with contextlib.suppress(PodmigrateError):
        ctx.save()


def _unlock(ctx: Ctx) -> None:
    try:
        pod = ctx.api.get(k.pods(ctx.ns, ctx.spec.get("podName", "")))
        if pod and (pod["metadata"].get("annotations") or {}).get(LOCK) == ctx.name:
            ctx.api.patch(k.pods(ctx.ns, ctx.spec["podName"]), {"metadata": {"annotations": {LOCK: None}}})
    except PodmigrateError:
        pass  # a stale lock names a finished migration, which the next validate ignores
