"""The phases of a streamed migration (``transport: stream``) and their undos.

``page-server``: the copy's pod is created on the target before the source is touched, with the
podmigrate RuntimeClass and ``io.podmigrate.stream``; its first container's ``create`` starts a CRIU
page server and waits (``runtime.runc_restore``), so the sandbox, the image and the container's set-up
are done before the freeze. The Services are handed to slices of the operator's first
(``k8s.handover``). ``checkpoint``: the source paused (stop-copy, lazy), per container, in the pod's
order (the kubelet starts them one after the other), the target's agent relays to that container's
page server, the source's agent dumps with runc into the relay, and the target's agent verifies the
rest: the waiting ``create`` restores at once, its memory left to a local lazy-pages daemon.
``restore`` (``k8s.phases``) then only waits until the copy serves, ``cutover`` writes its address
into the operator's slices, ``pages`` waits for the daemon's (or, lazy, the source's) last page.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from podmigrate.errors import PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.k8s import handover, proxies
from podmigrate.k8s.context import Ctx
from podmigrate.k8s.pods import pod_copy, wait_gone
from podmigrate.k8s.runtimes import RUNTIME_CLASS

STREAM = "io.podmigrate.stream"  # runtime.runc_restore reads these
WAIT = "io.podmigrate.wait-seconds"
LAZY = "io.podmigrate.lazy"
# under the kubelet's 2-minute runtime request timeout: past it the kubelet would start the container again
WAIT_S = 110
MIN_RESERVE = 32 << 20
HANDBACK_S = 30.0  # a rollback: until the controller lists the source again (it is Ready: seconds at most)


def node_ip(ctx: Ctx, node: str) -> str:
    addresses = ((ctx.api.get(k.nodes(node)) or {}).get("status") or {}).get("addresses") or []
    ip = next((a["address"] for a in addresses if a.get("type") == "InternalIP"), None)
    if ip is None:
        raise PodmigrateError(f"node {node!r} reports no InternalIP: the agents cannot stream between nodes")
    return str(ip)


def page_server(ctx: Ctx) -> None:
    rec = ctx.rec
    # first: the proxies' sync for it is then behind by the cutover (kube-proxy's minSyncPeriod; settled below)
    marks = proxies.mark(ctx)
    handover.take(ctx)
    out = ctx.agents.call(rec["target"], "/v1/streams", {"checkpoint_id": rec["id"], "containers": rec["containers"]})
    rec["restore_dirs"] = out["restores"]
    ctx.save()
    _reserve(ctx)
    if ctx.api.get(k.pods(ctx.ns, rec["restored"])) is None:
        made = ctx.api.create(k.pods(ctx.ns), _copy(ctx))
        rec["copy_uid"] = str((made.get("metadata") or {}).get("uid") or "")
    first = rec["containers"][0]
    # lazy: no page server in the copy (its pages are fetched as it runs), but it waits all the same
    pages = {"pages": False, "wait": True} if ctx.spec["mode"] == "lazy" else {}
    rec["stream_ports"] = {
        first: _listen(ctx, first, **pages)
    }  # returns once that container waits with its page server
    rec["proxies"] = proxies.settle(ctx, marks)  # the cutover's rules then written at once


def _reserve(ctx: Ctx) -> None:
    """The heap's worth of memory touched on the target before the freeze: on a VM the first touch of
    guest memory costs seconds per GB, which the restore would otherwise pay inside the blackout."""
    rec = ctx.rec
    ids = [i for c, i in _container_ids(ctx).items() if c in rec["containers"] and i]
    try:
        size = int(ctx.agents.call(rec["source"], "/v1/streams/rss", {"container_ids": ids})["bytes"])
        if size >= MIN_RESERVE:  # small heaps are not worth it
            got = ctx.agents.call(rec["target"], f"/v1/checkpoints/{rec['id']}/reserve-memory", {"bytes": size})
            rec["target_memory"] = got
    except PodmigrateError as e:  # an optimisation: the migration runs without it
        ctx.event("Warning", "NoReservation", f"memory not warmed on {rec['target']}: {e.message}")


def _container_ids(ctx: Ctx) -> dict[str, str]:
    """Container name -> the runtime's id, from the source pod's status (``containerd://<id>``)."""
    pod = ctx.api.get(k.pods(ctx.ns, ctx.spec["podName"])) or {}
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return {s["name"]: str(s.get("containerID", "")).partition("://")[2] for s in statuses}


def _copy(ctx: Ctx) -> dict[str, Any]:
    rec = ctx.rec
    pod = pod_copy(rec["source_pod"], rec["restored"], rec["target"], {}, ctx.name)
    pod["spec"]["runtimeClassName"] = RUNTIME_CLASS
    ann = pod["metadata"]["annotations"]
    ann["io.podmigrate.restore"] = ann[STREAM] = ",".join(rec["containers"])
    if ctx.spec["mode"] == "lazy":  # the first container; the others come whole, as when streamed
        ann[LAZY] = rec["containers"][0]
    ann[WAIT] = str(WAIT_S)
    for c, path in rec["restore_dirs"].items():
        ann[f"io.podmigrate.restore-from.{c}"] = path
    return pod


def _listen(ctx: Ctx, container: str, **extra: Any) -> dict[str, Any]:
    rec = ctx.rec
    body = {"checkpoint_id": rec["id"], "container": container, "peer": node_ip(ctx, rec["source"]),
            "timeout": ctx.spec["timeouts"]["restoreSeconds"], **_seal(ctx), **extra}  # fmt: skip
    return dict(ctx.agents.call(rec["target"], "/v1/streams/listen", body))


def _seal(ctx: Ctx) -> dict[str, Any]:
    from podmigrate.k8s.phases import seal

    return seal(ctx)


def undo_page_server(ctx: Ctx) -> str:
    rec = ctx.rec
    with contextlib.suppress(PodmigrateError):  # the waiting create fails now instead of at its deadline
        ctx.agents.call(rec["target"], "/v1/streams/abort", {"checkpoint_id": rec["id"]})
    gone = ctx.api.delete(k.pods(ctx.ns, rec["restored"]))
    wait_gone(ctx, rec["restored"])
    handover.release(ctx, ctx.spec["podName"], HANDBACK_S)  # the source back in its Services' own slices
    ctx.agents.call(rec["target"], "/v1/restores/delete", {"checkpoint_id": rec["id"]})
    return f"deleted the waiting copy {rec['restored']}" if gone else f"pod {rec['restored']} was not there"


def checkpoint(ctx: Ctx) -> None:
    """The first container streams into its waiting copy; the others, at the same time, dump whole
    (a sidecar is small) and land verified on the target before the kubelet starts their copies, one
    after the other once the first one runs: none of them waits for its own page server then."""
    rec = ctx.rec
    ids = _container_ids(ctx)
    rec["source_ids"] = {c: ids.get(c, "") for c in rec["containers"]}
    if missing := [c for c in rec["containers"] if not ids.get(c)]:
        raise PodmigrateError(f"containers {missing} of {ctx.spec['podName']} report no container id: running?")
    first, *others = rec["containers"]
    ports = {**(rec.get("stream_ports") or {})}
    if first not in ports:  # resumed after the page-server phase by another operator
        ports[first] = _listen(ctx, first)
    urls = {n: ctx.agents.url(n) for n in (rec["source"], rec["target"])}
    peer, sealed = node_ip(ctx, rec["source"]), _seal(ctx)
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def move(c: str, listened: dict[str, Any] | None) -> None:
        try:
            if listened is None:  # no page server: the whole checkpoint goes as the rest
                body = {"checkpoint_id": rec["id"], "container": c, "peer": peer, "pages": False, **sealed}
                listened = ctx.agents.call_apart(rec["target"], urls[rec["target"]], "/v1/streams/listen", body)
            assert listened is not None
            if c == first and ctx.spec["mode"] == "lazy":
                results[c] = lazy(c, listened)
                return
            body = {"checkpoint_id": rec["id"], "container": c, "container_id": ids[c], "leave_running": True,
                    "pause": ctx.spec["mode"] != "decoupled",
                    "target": listened["address"], "pages_port": listened.get("pages_port"),
                    "rest_port": listened["rest_port"], "timeout": ctx.spec["timeouts"]["checkpointSeconds"],
                    **sealed}  # fmt: skip
            out = ctx.agents.call_apart(rec["source"], urls[rec["source"]], "/v1/streams/checkpoint", body)
            done = {"checkpoint_id": rec["id"], "container": c}
            verified = ctx.agents.call_apart(rec["target"], urls[rec["target"]], "/v1/streams/verify", done)
            results[c] = {"dump_s": round(out["seconds"], 3), "pages_bytes": out["pages_bytes"],
                          "rest_bytes": out["rest_bytes"], "path": verified["path"]}  # fmt: skip
        except BaseException as e:  # re-raised in the phase's thread
            errors.append(e)

    def lazy(c: str, listened: dict[str, Any]) -> dict[str, Any]:
        body = {"checkpoint_id": rec["id"], "container": c, "container_id": ids[c], "target": listened["address"],
                "rest_port": listened["rest_port"], "pause": True, **sealed}  # fmt: skip
        t0 = time.time()
        out = ctx.agents.call_apart(rec["source"], urls[rec["source"]], "/v1/streams/lazy", body)
        t1 = time.time()
        done = {"checkpoint_id": rec["id"], "container": c, "lazy": {"address": out["address"],
                "port": out["lazy_port"]}, **sealed}  # fmt: skip
        verified = ctx.agents.call_apart(rec["target"], urls[rec["target"]], "/v1/streams/verify", done)
        steps = {
            **(out.get("steps") or {}),
            "source_call": round(t1 - t0, 4),
            "verify_call": round(time.time() - t1, 4),
        }
        return {"dump_s": round(out["seconds"], 3), "pages_bytes": 0, "rest_bytes": out["rest_bytes"],
                "path": verified["path"], "lazy": True, "prefetch": out.get("prefetch") or {},
                "steps": steps}  # fmt: skip

    if ctx.spec["mode"] != "decoupled":  # paused for its dump: the blackout starts here (no isolate)
        rec["frozen_at"] = time.time()
    threads = [threading.Thread(target=move, args=(c, None), daemon=True) for c in others]
    for t in threads:
        t.start()
    move(first, ports[first])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    rec["checkpointed_at"] = time.time()
    rec["stream"] = results
    rec["bytes"] = sum(int(s["pages_bytes"]) + int(s["rest_bytes"]) for s in results.values())


def undo_checkpoint(ctx: Ctx) -> str:
    """The source was left running and its dump directory is gone with the request: only the waiting
    copy needs telling (the page-server phase's undo deletes it). A lazy dump still serving is killed
    and the source thawed."""
    if ctx.spec["mode"] == "lazy":
        ctx.agents.call(ctx.rec["source"], "/v1/streams/lazy/abort", {"checkpoint_id": ctx.rec["id"]})
    if ctx.spec["mode"] != "decoupled":  # paused for its dump: the source serves on
        ctx.agents.call(ctx.rec["source"], "/v1/streams/thaw", {"container_ids": _source_ids(ctx)})
    with contextlib.suppress(PodmigrateError):
        ctx.agents.call(ctx.rec["target"], "/v1/streams/abort", {"checkpoint_id": ctx.rec["id"]})
    return "aborted the streamed restore on the target"


def end_source(ctx: Ctx) -> None:
    """Kill the paused source's containers once its pod is being deleted (a frozen process does not
    act on SIGTERM: its memory would be held for the whole grace period)."""
    ctx.agents.call(ctx.rec["source"], "/v1/streams/kill", {"container_ids": _source_ids(ctx)})


def _source_ids(ctx: Ctx) -> list[str]:
    """The containers this migration paused (recorded at its checkpoint, whatever the pod says now)."""
    return [i for i in (ctx.rec.get("source_ids") or {}).values() if i]


def pages(ctx: Ctx) -> None:
    """The copy serves; wait for the rest of its memory. Lazy: from the source, whose CRIU ends then;
    streamed: from the images the page server wrote on the target, which cleanup deletes after."""
    rec = ctx.rec
    first = rec["containers"][0]
    body = {"checkpoint_id": rec["id"], "container": first, "timeout": ctx.spec["timeouts"]["restoreSeconds"]}
    if ctx.spec["mode"] != "lazy":
        got = ctx.agents.call(rec["target"], "/v1/streams/pages", body)
        if got.get("lazy"):  # else the restore read them all (its daemon did not start)
            moved, took = int(rec["stream"][first]["pages_bytes"]), max(float(got["seconds"]), 1e-6)
            rec["stream"][first].update(pages_s=round(took, 3), pages_mb_s=round(moved / 2**20 / took, 1))
        return
    out = ctx.agents.call(rec["source"], "/v1/streams/lazy/wait", body)
    moved = int(out["bytes"])
    rec["stream"][first]["pages_bytes"] = moved
    rec["stream"][first]["pages_s"] = round(float(out["seconds"]), 3)
    rec["stream"][first]["pages_mb_s"] = round(moved / 2**20 / max(float(out["seconds"]), 1e-6), 1)
    rec["bytes"] = int(rec.get("bytes", 0)) + moved
