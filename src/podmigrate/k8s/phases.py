"""The Kubernetes phases and their undos, bound to the plan table's phase names.

``engine.plans`` orders them (rows ``kubernetes``); ``k8s.validate`` is the first; ``k8s.pods``
creates and waits for pods; the node agent (``k8s.agent``, through ``k8s.agents``) checkpoints and
packages. ``isolate`` takes the source out of its Services, so in stop-copy no request reaches it
after its checkpoint: stop-copy hands them over (``k8s.handover``: the operator's EndpointSlices,
emptied, then switched to the copy in one write as soon as it serves); cold moves their selectors off
every pod, and its ``cutover`` pins each selector to the copy with the ``podmigrate.io/instance``
label, after which exactly one pod serves. Decoupled and streamed migrations hand their Services over
too, taken before the checkpoint and never emptied.
``cleanup`` deletes the source pod, the archives and the images, failures are warnings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from podmigrate.engine.plans import PhaseName as P
from podmigrate.engine.runner import Phase, phase_table
from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s import handover, proxies, stream_phases
from podmigrate.k8s.conntrack import forget_source
from podmigrate.k8s.context import INSTANCE, Ctx
from podmigrate.k8s.pods import pod_copy, wait_gone, wait_ready
from podmigrate.k8s.policy import by_digest
from podmigrate.k8s.runtimes import RUNTIME_CLASS
from podmigrate.k8s.validate import validate

RESTORE = "io.podmigrate.restore"  # runtime.runc_restore reads these (pod annotations reach its spec)
RESTORE_FROM = "io.podmigrate.restore-from"


def set_selectors(ctx: Ctx, instance: str | None) -> None:
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
    marks = proxies.mark(ctx)
    if ctx.spec["mode"] == "stop-copy":
        # the operator's slices, emptied: at the cutover they list the copy as soon as it serves, one
        # write, instead of waiting for the kubelet's Ready and the controller's slice
        handover.take(ctx)
        handover.empty(ctx)
    else:  # cold: a fresh pod, which the Services take in as Kubernetes always does
        set_selectors(ctx, f"isolated-{ctx.rec['id']}")  # no pod carries it: the Services go empty
    ctx.rec["isolated_at"] = time.time()
    _wait_unserved(ctx)
    ctx.rec["proxies"] = proxies.follow(ctx, marks)  # only then does no request reach the source any more


def _wait_unserved(ctx: Ctx, timeout: float = 10.0) -> None:
    """Wait until no EndpointSlice of the Services lists the source as ready: kube-proxy (or Cilium)
    follows the slices, so only then does no new request reach the source. Connections already open
    to it stay open; a stop-copy checkpoint sees their last requests."""
    source = ctx.spec["podName"]
    deadline = time.monotonic() + timeout
    serving: list[str] = []
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
        time.sleep(ctx.config.blackout_poll_s)
    ctx.event("Warning", "StillServing", f"{source} still listed in {sorted(set(serving))} after {timeout:.0f} s")


def drain(ctx: Ctx) -> None:
    """Before a source that served up to the cutover goes: its EndpointSlices drop it, and then every
    node's proxy must rewrite its rules (kube-proxy waits at least its minSyncPeriod, 1 s by default,
    between two syncs: ``k8s.proxies``). A source deleted sooner refuses the requests still sent to
    it: 4 of 10 decoupled migrations failed probes at the cutover that way (bench k8s, 2026-12-07)."""
    _wait_unserved(ctx)
    proxies.follow(ctx, ctx.rec.get("proxy_marks") or {})


def undo_selectors(ctx: Ctx) -> str:
    set_selectors(ctx, None)
    return f"restored the selectors of {sorted(ctx.rec['services'])}"


def undo_isolate(ctx: Ctx) -> str:
    if "handover" in ctx.rec:  # the source, still running, back in its Services' own slices
        return handover.release(ctx, ctx.spec["podName"], stream_phases.HANDBACK_S) or "Services given back"
    return undo_selectors(ctx)


def stop(ctx: Ctx) -> None:
    ctx.api.delete(k.pods(ctx.ns, ctx.spec["podName"]))
    wait_gone(ctx, ctx.spec["podName"])


def undo_stop(ctx: Ctx) -> str:
    src = ctx.rec["source_pod"]
    if ctx.api.get(k.pods(ctx.ns, src["metadata"]["name"])) is None:
        ctx.api.create(k.pods(ctx.ns), pod_copy(src, src["metadata"]["name"], ctx.rec["source"], {}))
    wait_ready(ctx, src["metadata"]["name"], ctx.spec["timeouts"]["restoreSeconds"], cancellable=False)
    return f"started {src['metadata']['name']} again on {ctx.rec['source']} (fresh: a cold restart keeps no state)"


def checkpoint(ctx: Ctx) -> None:
    if ctx.rec.get("transport") == "stream":
        return stream_phases.checkpoint(ctx)
    if ctx.spec["mode"] == "decoupled":
        # the kubelet's checkpoint freezes the source for seconds: its readiness probe fails, the
        # controller drops it from the Services and adds it back, and clients are refused meanwhile.
        # The operator's slices keep it served, and make the cutover one write.
        handover.take(ctx)
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
    if ctx.rec.get("transport") == "stream":
        return stream_phases.undo_checkpoint(ctx)
    # the Services first: deleting the archives needs the source's agent, which may be what failed
    given = ""
    if "handover" in ctx.rec:  # back to their own selectors (a warning if slow: they serve)
        given = "; " + (handover.release(ctx, ctx.spec["podName"], stream_phases.HANDBACK_S) or "Services given back")
    return delete_archives(ctx) + given


def delete_archives(ctx: Ctx) -> str:
    body = {"checkpoint_id": ctx.rec["id"], "containers": ctx.rec["containers"]}
    out = ctx.agents.call(ctx.rec["source"], "/v1/archives/delete", body)
    return f"deleted archives {sorted(p for p, was in out['deleted'].items() if was)}"


def seal(ctx: Ctx) -> dict[str, Any]:
    """The request field that seals (push) or opens (restore) this migration's images. Only on the
    RuntimeClass path, where the target's agent reads the image; containerd's CRI restore reads it
    itself and cannot open a sealed layer."""
    if not ctx.rec.get("sealed"):
        return {}
    key = ctx.config.seal_key(ctx.rec["id"])
    if key is None:
        raise PodmigrateError(
            f"migration {ctx.rec['id']} sealed its images, and this operator has no seal key to open them",
            hint="give the operator the Secret podmigrate-seal-key it ran with (PODMIGRATE_SEAL_KEY)",
        )
    return {"seal": key}


def package(ctx: Ctx) -> None:
    sealed = seal(ctx)
    out = ctx.agents.call(
        ctx.rec["source"],
        "/v1/images",
        {
            "namespace": ctx.ns,
            "pod": ctx.spec["podName"],
            "checkpoint_id": ctx.rec["id"],
            "archives": ctx.rec["archives"],
            "references": ctx.rec["references"],
            "compression": ctx.spec["compression"],
            **sealed,
        },
    )
    ctx.rec["images"] = {c: i["reference"] for c, i in out["images"].items()}
    ctx.rec["digests"] = {c: i["manifest_digest"] for c, i in out["images"].items()}
    ctx.rec["bytes"] = sum(int(i["bytes"]) for i in out["images"].values())


def delete_images(ctx: Ctx) -> Any:
    body = {"namespace": ctx.ns, "references": list(ctx.rec["references"].values())}
    return ctx.agents.call(ctx.rec["source"], "/v1/images/delete", body)


def undo_package(ctx: Ctx) -> str:
    delete_archives(ctx)  # archives are deleted after a push; a failed push leaves them
    delete_images(ctx)
    return f"deleted checkpoint images {list(ctx.rec['references'].values())}"


def restore(ctx: Ctx) -> None:
    rec = ctx.rec
    if rec.get("transport") == "stream":  # the copy exists since page-server, and serves before it is Ready
        handover.wait_serving(ctx)
        return
    if "handover" in rec:  # the Services are the operator's slices: the copy is handed them once it serves
        if ctx.api.get(k.pods(ctx.ns, rec["restored"])) is None:
            ctx.api.create(k.pods(ctx.ns), _copy(ctx))
        handover.wait_serving(ctx)
        return
    if "isolated_at" not in rec:
        # make-before-break: pin the Services to the source first, or the copy would join them (and two
        # pods serve) as soon as it is ready, before the cutover chose it
        src = ctx.spec["podName"]
        ctx.api.patch(k.pods(ctx.ns, src), {"metadata": {"labels": {INSTANCE: src}}})
        set_selectors(ctx, src)
    if ctx.api.get(k.pods(ctx.ns, rec["restored"])) is None:  # resumed: it may exist already
        ctx.api.create(k.pods(ctx.ns), _copy(ctx))
    copy = wait_ready(ctx, rec["restored"], ctx.spec["timeouts"]["restoreSeconds"])
    rec["pod_ip"] = str((copy.get("status") or {}).get("podIP") or "")


def _copy(ctx: Ctx) -> dict[str, Any]:
    """The restored pod. cri: its checkpointed containers run their checkpoint images, by digest (a tag
    can be moved; the digest is what the source pushed). runtimeclass: its original images, the
    podmigrate RuntimeClass and, per container, the directory the target's agent verified."""
    rec = ctx.rec
    refs, digests = rec.get("images") or {}, rec.get("digests") or {}
    if missing := sorted(set(refs) - set(digests)):  # never fall back to the tag: it can be moved
        raise PodmigrateError(f"no pushed digest recorded for {missing}; refusing to restore by tag")
    if rec.get("restore_path") != "runtimeclass":
        images = {c: by_digest(ref, digests[c]) for c, ref in refs.items()}
        return pod_copy(rec["source_pod"], rec["restored"], rec["target"], images, ctx.name)
    if refs:
        body = {  # the agent pulls ``reference@digest``, and checks the registry's answer against it
            "checkpoint_id": rec["id"],
            "namespace": ctx.ns,
            "images": {c: {"reference": r, "digest": digests[c]} for c, r in refs.items()},
            **seal(ctx),
        }
        out = ctx.agents.call(rec["target"], "/v1/restores", body)
        rec["restore_dirs"] = {c: r["path"] for c, r in out["restores"].items()}
        ctx.save()
    pod = pod_copy(rec["source_pod"], rec["restored"], rec["target"], {}, ctx.name)
    pod["spec"]["runtimeClassName"] = RUNTIME_CLASS
    ann = pod["metadata"]["annotations"]
    ann[RESTORE] = ",".join(sorted(rec.get("restore_dirs") or {}))
    for c, path in (rec.get("restore_dirs") or {}).items():
        ann[f"{RESTORE_FROM}.{c}"] = path
    return pod


def undo_restore(ctx: Ctx) -> str:
    gone = ctx.api.delete(k.pods(ctx.ns, str(ctx.rec["restored"])))
    if "isolated_at" not in ctx.rec:
        set_selectors(ctx, None)
    if ctx.rec.get("restore_path") == "runtimeclass":
        wait_gone(ctx, str(ctx.rec["restored"]))
        ctx.agents.call(ctx.rec["target"], "/v1/restores/delete", {"checkpoint_id": ctx.rec["id"]})
    return f"deleted pod {ctx.rec['restored']}" if gone else f"pod {ctx.rec['restored']} was not there"


def cutover(ctx: Ctx) -> None:
    if ctx.spec["mode"] == "decoupled":  # for the drain before the source goes (cleanup)
        ctx.rec["proxy_marks"] = proxies.mark(ctx)
    if "handover" in ctx.rec:  # one write: the operator's slices list the copy
        handover.switch(ctx, ctx.rec["pod_ip"])
        ctx.rec["cutover_at"] = time.time()
        return
    ctx.api.patch(k.pods(ctx.ns, ctx.rec["restored"]), {"metadata": {"labels": {INSTANCE: ctx.rec["restored"]}}})
    set_selectors(ctx, ctx.rec["restored"])
    ctx.rec["cutover_at"] = time.time()


def undo_cutover(ctx: Ctx) -> str:
    if "handover" in ctx.rec:  # the copy (deleted next) never joins the Services
        return handover.switch_back(ctx)
    return undo_selectors(ctx)


def cleanup(ctx: Ctx) -> None:
    rec = ctx.rec
    warnings: list[str] = []
    steps: list[tuple[str, Callable[[], Any]]] = []
    if ctx.spec["mode"] == "decoupled":  # the source served until the cutover: let the proxies follow first
        steps.append(("let the Services' proxies leave the source", lambda: drain(ctx)))
    if ctx.spec["mode"] != "cold":
        source = ctx.api.get(k.pods(ctx.ns, ctx.spec["podName"])) or {}
        steps.append(("delete source pod", lambda: ctx.api.delete(k.pods(ctx.ns, ctx.spec["podName"]))))
    if rec.get("transport") == "stream" and ctx.spec["mode"] != "decoupled":  # frozen since its dump
        steps.append(("end the frozen source", lambda: stream_phases.end_source(ctx)))
    if ctx.spec["mode"] != "cold":  # clients' unanswered SYNs to it, remembered by the nodes
        ip = str((source.get("status") or {}).get("podIP") or "")

        def forget() -> None:
            rec["conntrack"] = forget_source(ctx, ip)

        steps.append(("forget the source's connections", forget))
    # with the source gone the Services' own selectors pick the copy alone: give them back unpinned
    if "handover" in rec:  # and the operator's slices go once the controller lists the copy
        steps.append(("hand the Services back", lambda: _warn(handover.release(ctx, rec["restored"], _handback(ctx)))))
    else:
        steps.append(("restore the Services' selectors", lambda: set_selectors(ctx, None)))
    if rec.get("references") and rec.get("transport") != "stream":  # a streamed one made neither
        steps.append(("delete checkpoint images", lambda: delete_images(ctx)))
        steps.append(("delete archives", lambda: delete_archives(ctx)))
    if rec.get("restore_dirs"):  # the restored process runs from memory; a restart starts fresh anyway
        body = {"checkpoint_id": rec["id"]}
        steps.append(
            ("delete unpacked checkpoints", lambda: ctx.agents.call(rec["target"], "/v1/restores/delete", body))
        )
    for what, fn in steps:
        try:
            fn()
        except PodmigrateError as e:
            warnings.append(f"{what}: {e.message}")
    rec["warnings"] = rec.get("warnings", []) + warnings


def _warn(message: str | None) -> None:
    if message:
        raise PodmigrateError(message)


def _handback(ctx: Ctx) -> float:
    return float(ctx.spec["timeouts"]["restoreSeconds"])


PHASES = phase_table(
    Phase(P.VALIDATE, validate),
    # stream: the copy's pod waits on the target before anything else happens to the source
    Phase(P.PAGE_SERVER, stream_phases.page_server, stream_phases.undo_page_server),
    # cutover undoes first (the source back in the selectors, or in the operator's slices), then isolate
    Phase(P.ISOLATE, isolate, undo_isolate),
    Phase(P.STOP, stop, undo_stop),
    # checkpoint and package only make copies: a failed undo there is a leftover, the pod is safe
    Phase(P.CHECKPOINT, checkpoint, undo_checkpoint, artifact=True),
    Phase(P.PACKAGE, package, undo_package, artifact=True),
    Phase(P.RESTORE, restore, undo_restore),
    Phase(P.CUTOVER, cutover, undo_cutover),
    Phase(P.PAGES, stream_phases.pages),  # past the commit (cutover): nothing to undo
    Phase(P.CLEANUP, cleanup),
)
