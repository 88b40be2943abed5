"""The copy of a pod on its target node, and waiting for pods to come up or go (Kubernetes).

Neighbours: ``k8s.phases`` creates and deletes pods with these; ``k8s.api`` talks to the API server.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any

from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s.context import INSTANCE, Ctx

ORIGINAL = "podmigrate.io/original"  # the pod's own images and RuntimeClass, kept across copies
RESTORE_PREFIX = "io.podmigrate."  # what one RuntimeClass restore needed: never carried to the next copy

# pod states from which a restore will not recover by waiting
FATAL_WAITING = (
    "ErrImagePull",
    "ImagePullBackOff",
    "CreateContainerError",
    "RunContainerError",  # containerd restores in StartContainer: a failed restore ends there
    "CrashLoopBackOff",
    "InvalidImageName",
)


def pod_copy(src: dict[str, Any], name: str, node: str, images: dict[str, str], migration: str = "") -> dict[str, Any]:
    """``src`` as a new pod ``name`` pinned to ``node``, its containers' images replaced by ``images``."""
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
    annotations = {
        k: v for k, v in (src["metadata"].get("annotations") or {}).items() if not k.startswith(RESTORE_PREFIX)
    }
    # a copy runs checkpoint images (cri) or the podmigrate RuntimeClass; the next copy of it, a cold
    # restart or a restarted source must get the pod's own images and class back, not those
    original = json.loads(annotations.get(ORIGINAL, "null")) or {
        "images": {c["name"]: c["image"] for c in spec["containers"]},
        "runtimeClassName": spec.get("runtimeClassName"),
    }
    annotations[ORIGINAL] = json.dumps(original, sort_keys=True)
    if original.get("runtimeClassName"):
        spec["runtimeClassName"] = original["runtimeClassName"]
    else:
        spec.pop("runtimeClassName", None)
    for c in spec["containers"]:
        c["image"] = images.get(c["name"]) or original["images"].get(c["name"], c["image"])
        if c["name"] in images:
            c["imagePullPolicy"] = "IfNotPresent"
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


def wait_ready(
    ctx: Ctx,
    name: str,
    timeout: float,
    cancellable: bool = True,
    serving: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Until pod ``name`` is Ready, or ``serving(pod)`` says it serves (whichever comes first): the pod
    as it was then."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        pod = ctx.api.get(k.pods(ctx.ns, name))
        # every caller created it just before; one being deleted never becomes ready (the kubelet may
        # first report it Failed with no reason: polled fast, that hid the deletion)
        if pod is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
            raise PodmigrateError(
                f"pod {name} vanished while it started (deleted, or its node failed)",
                hint="kubectl get events; check the target node",
            )
        if k.pod_ready(pod) or (serving is not None and serving(pod)):
            return pod
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
        if cancellable:
            ctx.check_cancelled()
        time.sleep(ctx.config.blackout_poll_s)
    raise PodmigrateError(
        f"pod {name} not ready after {timeout:.0f} s" + (f" (last: {last})" if last else ""),
        hint="raise spec.timeouts.restoreSeconds for big heaps, or check the target node",
    )


def wait_gone(ctx: Ctx, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while ctx.api.get(k.pods(ctx.ns, name)) is not None:
        if time.monotonic() > deadline:
            raise PodmigrateError(f"pod {name} still exists {timeout:.0f} s after its deletion")
        time.sleep(ctx.config.poll_s)
