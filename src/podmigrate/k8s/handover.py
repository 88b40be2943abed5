"""A migration's Services handed from the source to the copy in one EndpointSlice write (streamed
migrations, and decoupled and stop-copy ones through the kubelet; a stop-copy empties the slices at
its isolation).

kube-proxy (and Cilium) serve a Service from every EndpointSlice labelled with its name, whoever
manages it. Before the freeze (``take``) the operator writes one slice of its own per Service
(``endpointslice.kubernetes.io/managed-by: podmigrate.io``) listing the source as the EndpointSlice
controller lists it, then moves the Service's selector off every pod: what a proxy serves does not
change. At the cutover (``switch``) that slice's endpoint becomes the copy, as soon as the copy
serves (the target's agent runs its readiness probes, ``k8s.serving``): one change, applied at the
proxies' next sync. Without it the cutover waited for the kubelet (its sync, the probe's period, its
status), the controller's update of its slice, and two changes within the blackout, the second held
back by kube-proxy's ``minSyncPeriod`` (1 s by default). After it (``release``) the Service's own
selector comes back; once the controller's slice lists the copy as ready, the operator's slice goes.
Each slice is owned by its PodLiveMigration: deleting that deletes the slice too.
"""

from __future__ import annotations

import time
from typing import Any

from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s.context import Ctx

MANAGED_BY = "podmigrate.io"
MIGRATION = "podmigrate.io/migration"
SERVICE = "kubernetes.io/service-name"
OURS = f"endpointslice.kubernetes.io/managed-by={MANAGED_BY}"


def slices(ns: str, name: str = "") -> str:
    return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices" + (f"/{name}" if name else "")


def _controllers(ctx: Ctx, svc: str) -> list[dict[str, Any]]:
    """The Service's slices that are not ours (the EndpointSlice controller's, or a mirror's)."""
    got = ctx.api.list(slices(ctx.ns), label_selector=f"{SERVICE}={svc}")
    return [s for s in got if (s["metadata"].get("labels") or {}).get("endpointslice.kubernetes.io/managed-by")
            != MANAGED_BY]  # fmt: skip


def _listed(sl: dict[str, Any], pod: str, ready: bool = False) -> list[dict[str, Any]]:
    return [
        e
        for e in sl.get("endpoints") or []
        if (e.get("targetRef") or {}).get("name") == pod and (not ready or (e.get("conditions") or {}).get("ready"))
    ]


def take(ctx: Ctx) -> None:
    """The Services' endpoints for the source into slices of the operator's; then their selectors
    match no pod (the copy never joins them before the switch)."""
    from podmigrate.k8s.phases import set_selectors

    rec, src = ctx.rec, ctx.spec["podName"]
    plm = ctx.plm() or {}
    owner = {"apiVersion": plm.get("apiVersion", "podmigrate.io/v1alpha1"), "kind": "PodLiveMigration",
             "name": ctx.name, "uid": (plm.get("metadata") or {}).get("uid", ""), "controller": True}  # fmt: skip
    made: dict[str, list[str]] = dict(rec.get("handover") or {})
    listing = {svc: [s for s in _controllers(ctx, svc) if _listed(s, src)] for svc in rec["services"]}
    if missing := sorted(svc for svc, found in listing.items() if not found and not made.get(svc)):
        raise PodmigrateError(
            f"Services {missing} do not list {src} as an endpoint: handed over, they would serve nothing",
            hint="wait until its Services list the pod (kubectl get endpointslices), then migrate again",
        )
    for svc, found in listing.items():
        for i, sl in enumerate(found):
            name = f"{svc}-podmigrate-{rec['id']}-{i}"[:253]
            if name in made.get(svc, []):
                continue  # resumed: made already
            body = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": ctx.ns,
                    "ownerReferences": [owner] if owner["uid"] else [],
                    "labels": {
                        SERVICE: svc,
                        "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
                        MIGRATION: rec["id"],
                    },
                },
                "addressType": sl["addressType"],
                "ports": sl.get("ports") or [],
                "endpoints": _listed(sl, src),
            }
            ctx.api.create(slices(ctx.ns), body)
            made.setdefault(svc, []).append(name)
            rec["handover"] = made
            rec["handover_ports"] = [*(rec.get("handover_ports") or []), body["ports"]]
            rec["handover_endpoints"] = {**(rec.get("handover_endpoints") or {}), name: body["endpoints"]}
            ctx.save()
    rec["handover"] = made
    set_selectors(ctx, f"handed-over-{rec['id']}")  # no pod carries it: the controller's slices empty


def empty(ctx: Ctx) -> None:
    """The operator's slices list no endpoint (a stop-copy's isolation: nothing reaches the source)."""
    for names in (ctx.rec.get("handover") or {}).values():
        for name in names:
            ctx.api.patch(slices(ctx.ns, name), {"endpoints": []})


def switch(ctx: Ctx, pod_ip: str) -> None:
    """The operator's slices list the copy, ready, instead of the source."""
    rec = ctx.rec
    if not pod_ip:
        raise PodmigrateError(f"the address of {rec['restored']} is not known: its Services cannot be handed to it")
    # the copy's uid as the restore saw it serve: one API read less inside the blackout
    uid = rec.get("copy_uid") or ((ctx.api.get(k.pods(ctx.ns, rec["restored"])) or {}).get("metadata") or {}).get("uid")
    endpoint = {
        "addresses": [pod_ip],
        "conditions": {"ready": True, "serving": True, "terminating": False},
        "nodeName": rec["target"],
        "targetRef": {
            "kind": "Pod",
            "namespace": ctx.ns,
            "name": rec["restored"],
            "uid": uid or "",
        },
    }
    for names in (rec.get("handover") or {}).values():
        for name in names:
            ctx.api.patch(slices(ctx.ns, name), {"endpoints": [endpoint]})
    # a slice of a deleted Service serves nothing: the copy would take over no client. Asked after
    # the switch, off the blackout: the cutover's undo lists the source again
    if gone := sorted(svc for svc in rec.get("handover") or {} if ctx.api.get(k.services(ctx.ns, svc)) is None):
        raise PodmigrateError(
            f"Services {gone} were deleted during the migration: no client would reach the copy",
            hint="the migration rolls back and the source runs on; recreate them and migrate again",
        )


def switch_back(ctx: Ctx) -> str:
    """A cutover undone: the operator's slices list the source again, as ``take`` copied it (the
    selectors stay handed over: the copy, about to be deleted, must not join the Services)."""
    endpoints = ctx.rec.get("handover_endpoints") or {}
    for names in (ctx.rec.get("handover") or {}).values():
        for name in names:
            ctx.api.patch(slices(ctx.ns, name), {"endpoints": endpoints.get(name) or []})
    return f"the Services' slices list {ctx.spec['podName']} again"


def release(ctx: Ctx, pod: str, timeout: float) -> str | None:
    """The Services' own selectors back; once the controller's slices list ``pod`` as ready (or after
    ``timeout``), the operator's slices go. A warning when they went without it."""
    from podmigrate.k8s.phases import set_selectors

    rec = ctx.rec
    deadline = time.monotonic() + timeout
    # first Ready as the kubelet says: the controller's slice then lists it ready at once. Listed
    # there not ready beside our ready entry, the same address may be taken as not ready (kube-proxy
    # keeps one entry per address, whichever slice it reads last), and with no ready endpoint left
    # the proxies fall back to a terminating source still serving: clients sent to a pod being killed
    while time.monotonic() < deadline and (got := ctx.api.get(k.pods(ctx.ns, pod))) and not k.pod_ready(got):
        time.sleep(ctx.config.poll_s / 5)
    set_selectors(ctx, None)
    waiting = [svc for svc in rec.get("handover") or {} if ctx.api.get(k.services(ctx.ns, svc)) is not None]
    while waiting and time.monotonic() < deadline:
        waiting = [svc for svc in waiting if not any(_listed(s, pod, ready=True) for s in _controllers(ctx, svc))]
        if waiting:
            time.sleep(ctx.config.poll_s / 5)
    drop(ctx)
    if waiting:
        return f"Services {waiting} do not list {pod} as ready after {timeout:.0f} s; podmigrate's slices deleted"
    return None


def drop(ctx: Ctx) -> None:
    """Delete the operator's slices of this migration (whatever the record says: by label)."""
    for sl in ctx.api.list(slices(ctx.ns), label_selector=f"{MIGRATION}={ctx.rec['id']},{OURS}"):
        ctx.api.delete(slices(ctx.ns, sl["metadata"]["name"]))
    ctx.rec["handover"] = {}


def wait_serving(ctx: Ctx) -> None:
    """restore, streamed: until the copy serves as its node's agent sees it (``k8s.serving``: its
    readiness probes and its Services' ports at its address), or the kubelet says Ready first (the
    only way where a probe is ``exec`` or ``grpc``, or its address is not known)."""
    from podmigrate.k8s.pods import wait_ready

    rec = ctx.rec
    first = rec["containers"][0]
    said_ip = ((rec.get("stream_ports") or {}).get(first) or {}).get("pod_ip")
    t0 = time.time()
    if said_ip and rec.get("copy_uid") and _serves_at_once(ctx, said_ip):
        rec["pod_ip"], rec["serving_s"] = said_ip, round(time.time() - t0, 3)
        return
    agent_checks = [True]

    def serves(pod: dict[str, Any]) -> bool:
        ip = said_ip or (pod.get("status") or {}).get("podIP")
        checks = _checks(pod, rec.get("handover_ports") or [])
        if not ip or not checks or not agent_checks[0]:  # nothing to run here: the kubelet's Ready decides
            return False
        body = {"address": ip, "checks": checks, "timeout": 1.0}  # a short ask: the pod is looked at between
        try:
            got = ctx.agents.call(rec["target"], "/v1/serving", body)
        except PodmigrateError as e:  # an agent that cannot check (one of an older podmigrate): Ready decides
            agent_checks[0] = False
            ctx.event("Warning", "NoServingCheck", f"the agent on {rec['target']} did not check the copy: {e.message}")
            return False
        if not got.get("serving"):
            return False
        rec["pod_ip"], rec["copy_uid"] = ip, (pod.get("metadata") or {}).get("uid", "")
        return True

    wait_ready(ctx, rec["restored"], ctx.spec["timeouts"]["restoreSeconds"], serving=serves)
    if "pod_ip" not in rec:  # the kubelet said Ready first
        pod = ctx.api.get(k.pods(ctx.ns, rec["restored"])) or {}
        rec["pod_ip"] = str((pod.get("status") or {}).get("podIP") or said_ip or "")
    else:
        rec["serving_s"] = round(time.time() - t0, 3)


def _serves_at_once(ctx: Ctx, ip: str) -> bool:
    """The copy serves, asked of its agent before any read of the pod: the sandbox said its address
    and the copy runs the source's probes (its pod was created from the source's)."""
    checks = _checks(ctx.rec["source_pod"], ctx.rec.get("handover_ports") or [])
    if not checks:
        return False
    try:
        got = ctx.agents.call(ctx.rec["target"], "/v1/serving", {"address": ip, "checks": checks, "timeout": 1.0})
    except PodmigrateError:
        return False  # the loop below asks again, and says why
    return bool(got.get("serving"))


def _checks(pod: dict[str, Any], slice_ports: list[list[dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """The copy's readiness probes as the agent runs them, and a connection to every port its
    Services' slices send to; None when one probe cannot be run from the agent (exec, grpc)."""
    checks: list[dict[str, Any]] = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        probe = c.get("readinessProbe")
        if not probe:
            continue
        named = {p.get("name"): p["containerPort"] for p in c.get("ports") or [] if p.get("name")}
        if "httpGet" in probe:
            g = probe["httpGet"]
            port = named.get(g["port"], g["port"])
            checks.append({"port": int(port), "path": g.get("path", "/"), "scheme": g.get("scheme", "HTTP"),
                           "headers": g.get("httpHeaders") or []})  # fmt: skip
        elif "tcpSocket" in probe:
            checks.append({"port": int(named.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"]))})
        else:
            return None
    ports = {int(p["port"]) for sl in slice_ports for p in sl
             if p.get("port") and p.get("protocol", "TCP") == "TCP"}  # fmt: skip
    return checks + [{"port": p} for p in sorted(ports)]
