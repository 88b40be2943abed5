"""Validate a PodLiveMigration: the pod, the target node, the Services, the lock (Kubernetes).

Neighbours: ``k8s.crd`` checks the spec's shape before this; ``k8s.phases`` runs what follows.
Every refusal is a ``SpecError`` naming the field, raised before anything changed.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s import runtimes
from podmigrate.k8s.context import LOCK, Ctx
from podmigrate.k8s.crd import SpecError, short_name
from podmigrate.k8s.policy import Refused


def validate(ctx: Ctx) -> None:
    rec, spec = ctx.rec, ctx.spec
    _allowed(ctx)
    pod = ctx.api.get(k.pods(ctx.ns, spec["podName"]))
    if pod is None:
        raise SpecError(f"spec.podName: there is no pod {spec['podName']!r} in namespace {ctx.ns!r}")
    meta = pod["metadata"]
    _not_held(ctx, pod)
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
    rec["transport"] = "none" if spec["mode"] == "cold" else spec.get("transport", "registry")
    if rec["transport"] == "stream":
        _can_stream(ctx, rec["source"], rec["target"])
    if spec["mode"] != "cold":
        rec["restore_path"] = _restore_path(ctx, rec["target"])
        # decided once, here: a restore opens what the push sealed, whatever the config says by then
        rec["sealed"] = rec["restore_path"] == "runtimeclass" and bool(ctx.config.seal_master)
        if rec["restore_path"] == "runtimeclass" and not rec["sealed"]:
            ctx.event(
                "Warning",
                "Unsealed",
                "the operator has no seal key (Secret podmigrate-seal-key, PODMIGRATE_SEAL_KEY): this pod's "
                "checkpoint images, its memory, rest in the registry unencrypted",
            )
    rec["source_pod"] = _clean_copy(pod, ctx.ns)
    rec.setdefault("id", f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}")
    rec["restored"] = f"{short_name(spec['podName'])}-m{rec['id'][-6:]}"
    base = _registry(ctx)
    rec["references"] = {c: f"{base}/{ctx.ns}-{short_name(spec['podName'])}-{c}:{rec['id']}".lower() for c in wanted}
    rec["services"] = _services(ctx, pod)
    if not rec["services"]:
        ctx.event("Warning", "NoService", "no Service selects the pod: nothing to switch at cutover")
    _warn_volumes(ctx, pod)
    rec["spec"] = spec  # from here on the spec the migration started with, whatever edits come later
    _lock(ctx, pod)


def _lock(ctx: Ctx, pod: dict[str, Any], attempts: int = 5) -> None:
    """The pod's lock, written only over the pod as it was read (its resourceVersion): two
    PodLiveMigrations validating one pod at once both read it unlocked, and the API server answers
    the second lock 409 Conflict instead of letting both freeze it. A 409 for any other change (the
    kubelet's status) is retried on the pod as it is now."""
    path = k.pods(ctx.ns, ctx.spec["podName"])
    for _ in range(attempts):
        version = pod["metadata"].get("resourceVersion")
        try:
            ctx.api.patch(path, {"metadata": {"resourceVersion": version, "annotations": {LOCK: ctx.name}}})
            return
        except k.KubeError as e:
            if e.status != 409:
                raise
        now = ctx.api.get(path)
        if now is None:
            raise SpecError(f"spec.podName: pod {ctx.spec['podName']!r} was deleted while it was validated")
        _not_held(ctx, now)
        pod = now
    raise PodmigrateError(
        f"pod {ctx.spec['podName']!r} changed under every one of {attempts} attempts to lock it (409 Conflict)",
        hint="something rewrites the pod continuously; apply the PodLiveMigration again once it settles",
    )


def _registry(ctx: Ctx) -> str:
    return str(ctx.spec.get("registry") or ctx.config.registry).rstrip("/")


def _allowed(ctx: Ctx) -> None:
    """Before any other read: the namespace is served, the pod is one of it, the registry is allowed."""
    policy = ctx.config.policy()
    try:
        policy.check_namespace(ctx.ns)
    except Refused as e:
        raise SpecError(f"PodLiveMigration {ctx.ns}/{ctx.name}: {e}", reason="NamespaceNotServed") from None
    for field in ("podName", "service"):
        # the schema's pattern already forbids it; a path separator would address another namespace
        if "/" in str(ctx.spec.get(field) or ""):
            raise SpecError(f"spec.{field}: a PodLiveMigration moves only pods of its own namespace {ctx.ns!r}")
    try:
        policy.check_registry(_registry(ctx), "spec.registry" if ctx.spec.get("registry") else "the registry")
    except Refused as e:
        raise SpecError(str(e), reason="RegistryNotAllowed") from None


def _can_stream(ctx: Ctx, source: str, target: str) -> None:
    """A streamed migration needs the source's agent to checkpoint with runc, the target's to take the
    pages, and a seal key: its pages cross the network sealed with the migration's key, or not at all."""
    if not ctx.config.seal_master:
        raise SpecError(
            "spec.transport: a streamed migration seals its pages with the migration's key, and this operator has none",
            hint="give the operator the Secret podmigrate-seal-key (podmigrate k8s secrets), or use transport registry",
        )
    for node, what, needs in ((source, "stream_checkpoint", "checkpoint with runc"), (target, "streams", "take pages")):
        try:
            ok = bool(ctx.agents.info(node).get(what))
        except PodmigrateError as e:
            raise SpecError(f"spec.transport: no agent answers on node {node!r} ({e.message})") from None
        if not ok:
            raise SpecError(
                f"spec.transport: the agent on node {node!r} cannot {needs} for a streamed migration",
                hint="install the agents with deploy/kubernetes/stream (hostPID, privileged), or transport registry",
            )


def _restore_path(ctx: Ctx, target: str) -> str:
    """cri or runtimeclass, as ``k8s.runtimes`` decides from what the target node reports."""
    node = ctx.api.get(k.nodes(target)) or {}
    rc = ctx.api.get(f"/apis/node.k8s.io/v1/runtimeclasses/{runtimes.RUNTIME_CLASS}")
    served = False
    if rc is not None:
        try:
            served = ctx.agents.info(target).get("restore_handler") == rc.get("handler")
        except PodmigrateError:
            served = False  # no agent there: the checkpoint phase says so with its own error
    wanted = "runtimeclass" if ctx.spec.get("transport") == "stream" else ctx.spec.get("restorePath", "auto")
    path, why = runtimes.choose(wanted, node, served)
    if path is None:
        raise SpecError(
            f"node {target!r} cannot restore a checkpoint: {why}",
            hint="install the podmigrate RuntimeClass on that node (deploy/kubernetes), pick another "
            "targetNode, or use mode: cold",
            reason="UnsupportedRuntime",
        )
    ctx.event("Normal", "RestorePath", f"restoring on {target} {why}")
    return path


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


def _not_held(ctx: Ctx, pod: dict[str, Any]) -> None:
    """Refused when another PodLiveMigration that has not ended holds the pod's lock."""
    holder = (pod["metadata"].get("annotations") or {}).get(LOCK)
    if holder and holder != ctx.name and _active(ctx, holder):
        raise SpecError(f"pod {ctx.spec['podName']!r} is already being migrated by PodLiveMigration {holder!r}")


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


_NOT_COPIED = frozenset({LOCK, "kubectl.kubernetes.io/last-applied-configuration"})


def _clean_copy(pod: dict[str, Any], ns: str) -> dict[str, Any]:
    meta = pod["metadata"]
    return {
        "metadata": {
            "name": meta["name"],
            "namespace": ns,
            "labels": meta.get("labels") or {},
            # kubectl's last-applied copy repeats the whole manifest, env values and all, into .status
            "annotations": {a: v for a, v in (meta.get("annotations") or {}).items() if a not in _NOT_COPIED},
        },
        "spec": pod["spec"],
    }
