"""Validate: find what moves and check both nodes before anything is frozen (lab).

Neighbours: ``context`` (what a phase gets), ``container``/``pod``/``lazy`` (the phases that follow),
``runtime.base.NodeCapabilities`` (what each node's agent reports and this phase checks).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from podmigrate.engine import inventory
from podmigrate.engine.phases import published
from podmigrate.engine.phases.context import Ctx
from podmigrate.engine.phases.fit import check_fit, check_spec, version
from podmigrate.errors import PodmigrateError, UsageError


def parse_probe(spec: str) -> tuple[int, str | None]:
    """'http:8000/healthz' -> (8000, '/healthz'); 'tcp:5432' -> (5432, None)."""
    kind, _, rest = spec.partition(":")
    port, slash, path = rest.partition("/")
    if kind not in ("http", "tcp") or not port.isdigit() or not 0 < int(port) < 65536 or (kind == "tcp" and slash):
        raise UsageError(f"not a probe: {spec!r}", hint="use http:PORT/PATH (e.g. http:8000/healthz) or tcp:PORT")
    return int(port), (f"/{path}" if kind == "http" else None)


def needs(rec: dict[str, Any] | Any) -> dict[str, str]:
    """The node capabilities this migration needs, each with what it is needed for."""
    want: dict[str, str] = {}
    if rec.get("mode") == "lazy":
        want["lazy_pages"] = "a lazy (post-copy) migration faults the copy's memory in over userfaultfd"
    if rec.get("mode") == "lazy" or rec.get("transport") == "stream":
        want["page_server"] = "the memory pages travel through a CRIU page server"
    if rec.get("scope") == "pod":
        want["pods"] = "a whole pod is checkpointed and restored at once"
    if rec.get("plan", {}).get("tcp_established") and rec.get("mode") != "cold":
        want["tcp_established"] = "open TCP connections are checkpointed (--no-tcp-established does without)"
    return want


def check_node(ctx: Ctx, node: str, info: dict[str, Any] | None = None) -> None:
    """CRIU's version and the capabilities the plan needs, from the node agent's own report (``info``:
    asked already)."""
    rec = ctx.rec
    info = info if info is not None else ctx.agent(node).get("/v1/info")
    if version(info.get("criu")) < (4, 2):
        raise PodmigrateError(
            f"{node} has CRIU {info.get('criu')}; 4.2 or newer is needed",
            hint="CRIU < 4.2 cannot dump sockets on kernels >= 6.16",
        )
    caps: dict[str, Any] = info.get("capabilities") or {}
    for cap, why in needs(rec).items():
        if not caps.get(cap, False):
            raise UsageError(
                f"{node} cannot take part in this migration: its runtime ({caps.get('runtime', 'unknown')}) "
                f"reports no {cap}, and {why}",
                hint="choose another mode or transport (podmigrate migrate --help), or another node",
                details={"node": node, "capabilities": caps},
            )
    rec.setdefault("nodes", {})[node] = {
        **{k: info.get(k) for k in ("podman", "runc", "criu", "disk_free_bytes", "mem_available_bytes", "cpuinfo")},
        "capabilities": caps,
    }


def _pod(ctx: Ctx, loc: inventory.Located) -> None:
    rec, c = ctx.rec, loc.container
    if rec["mode"] not in ("stop-copy", "decoupled"):
        raise UsageError(
            f"container {c['name']!r} belongs to a pod; pods move with --mode stop-copy or decoupled",
            hint="checkpointing one container of a pod alone would sever its loopback connections",
        )
    assert c["pod"] is not None
    pod = ctx.agent(loc.node).get(f"/v1/pods/{c['pod']}")
    only = list(rec["plan"].get("only") or [])
    unknown = sorted(set(only) - set(pod["members"]))
    if unknown:
        raise UsageError(
            f"pod {pod['name']!r} has no member {', '.join(unknown)}", hint=f"its members: {pod['members']}"
        )
    pod["checkpointed"] = [m for m in pod["members"] if not only or m in only]
    fresh = [m for m in pod["members"] if m not in pod["checkpointed"]]
    pod["fresh"] = [ctx.agent(loc.node).get(f"/v1/containers/{m}/spec") for m in fresh]
    if fresh:
        rec.setdefault("warnings", []).append(
            f"only {pod['checkpointed']} keep their state; {fresh} start fresh on {rec['target']}, and every "
            "loopback connection between them is severed (the study's single-container finding)"
        )
        ctx.report(f"⚠ {rec['warnings'][-1]}")
    rec["scope"] = "pod"
    rec["pod"] = pod
    rec["transport"] = "archive"  # each member's export, agent to agent
    if any(x["name"] in pod["members"] for x in ctx.agent(rec["target"]).get("/v1/containers")):
        raise UsageError(
            f"pod {pod['name']!r} has containers on {rec['target']} already",
            hint="remove them first, or run `podmigrate gc`",
        )


def image_on_target(ctx: Ctx, source: str, c: Any) -> dict[str, Any]:
    """The container's very image (by ID) on the target: pulled there, or, when it was built or imported
    on the source alone (or the target's same-named image is another one), sent from the source,
    SHA-256 checked in transit and its ID checked after the load. All before the freeze."""
    target, image_id = ctx.rec["target"], str(c.get("image_id") or "")
    got: dict[str, Any] = ctx.agent(target).post("/v1/images", {"image": c["image"], "id": image_id})
    if got.get("present", True) or not image_id:
        return got
    ctx.report(f"moving image {c['image']} ({image_id[:12]}) from {source} to {target}: {got.get('why')}")
    sent = ctx.agent(source).post("/v1/images/send", {"id": image_id, "node": target})
    body = {"checkpoint_id": sent["checkpoint_id"], "id": image_id, "image": c["image"]}
    ctx.agent(target).post("/v1/images/load", body)
    return {**got, "present": True, "moved_bytes": sent["bytes"]}


def refuse_leftovers(loc: inventory.Located, workload: str) -> None:
    """Stopped copies of the workload elsewhere (a failed run's) would confuse what runs where."""
    if loc.others:
        where = ", ".join(f"{n} ({ci['state']})" for n, ci in loc.others)
        raise UsageError(
            f"stopped copies of {workload!r} are left on {where}",
            hint="remove them first: podmigrate lab exec NODE -- podman rm NAME",
        )


REDACTED = "(not recorded)"


def validate(ctx: Ctx) -> None:
    rec = ctx.rec
    lab = ctx.lab
    loc = inventory.locate(lab, rec["workload"])
    c = loc.container
    if c["pod"] and not lab.moves_addresses:
        raise UsageError(
            f"{rec['workload']!r} is a pod: pods move only where the router moves their address",
            hint="migrate its containers one by one, or use a router that moves addresses",
        )
    if c["pod"]:
        _pod(ctx, loc)
    elif rec["plan"].get("only"):
        raise UsageError(f"{c['name']!r} is not in a pod; --only-container applies to pod members")
    if rec["target"] == loc.node:
        raise UsageError(
            f"{rec['workload']!r} already runs on {loc.node}",
            hint=f"pick another node: {', '.join(n for n in lab.nodes if n != loc.node)}",
        )
    refuse_leftovers(loc, rec["workload"])
    rec["source"] = loc.node
    rec["container"] = rec["pod"]["name"] if rec.get("scope") == "pod" else c["name"]
    rec["container_id"] = c["id"]
    rec["image"] = c["image"]
    rec["service_addresses"] = list(c["ips"])
    if lab.shared_segment:  # a second holder of the address would answer ARP for it too
        if rec["mode"] == "decoupled":
            raise UsageError(
                f"{rec['workload']!r} is on a segment the hosts share: a copy made while it serves would "
                "compete with it for its address",
                hint="use --mode stop-copy or lazy (the source is frozen before its copy exists)",
            )
        rec["copy_network"] = "keep-ip"  # and no copy before the freeze (container.speculate)
    # what the checks read, asked of both agents at once (each answer takes 25-60 ms here); the checks
    # then run in their order, so the first problem is the one reported, as before
    src, dst = ctx.agent(loc.node), ctx.agent(rec["target"])
    pod = rec.get("scope") == "pod"
    with ThreadPoolExecutor(4, "validate") as pool:
        infos = {n: pool.submit(a.get, "/v1/info") for n, a in ((loc.node, src), (rec["target"], dst))}
        spec_f = None if pod else pool.submit(src.get, f"/v1/containers/{c['name']}/spec")
        mem_f = None if pod else pool.submit(src.get, f"/v1/containers/{c['name']}/memory")
        for n, info in infos.items():
            check_node(ctx, n, info.result())
        if spec_f is not None:
            spec = spec_f.result()
            if lab.moves_addresses:
                check_spec(spec, c["name"], lab.workload_network)
            else:  # reached at its host's published ports
                check_spec({**spec, "ports": []}, c["name"], lab.workload_network)
                published.take(ctx, published.check(spec, c["name"], rec["mode"]))
            if rec["mode"] == "cold":
                # names only: environment values are often secrets, and the record outlives the run; the
                # values are read again from the source's container when the spec is used
                rec["spec"] = {**spec, "env": {k: REDACTED for k in spec.get("env") or {}}}
        rss = 0 if mem_f is None else mem_f.result()["rss_bytes"]
    rec["rss_bytes"] = rss  # what the plan of an evacuation learns its rates from (engine.rates)
    check_fit(ctx, rss)
    # The target needs the container's base image; fetching it now keeps it out of the blackout. The
    # workload's state is read meanwhile (the longest step: a heap server hashes its heap).
    ctx.observer()  # made here: the state is read in another thread
    with ThreadPoolExecutor(1, "state") as pool:
        state = pool.submit(probe_and_state, ctx, loc)
        if pod:  # every member's own image, each by ID (a sidecar's may be local-only)
            members = {x["name"]: x for x in src.get("/v1/containers")}
            rec["member_images"] = {
                m: image_on_target(ctx, loc.node, members[m]) for m in rec["pod"]["members"] if m in members
            }
        else:
            rec["target_image"] = image_on_target(ctx, loc.node, c)
        # warm the target's memory for the restore now, outside the blackout (see the agent's
        # reserve-memory); small containers are not worth it
        if rec["mode"] in ("stop-copy", "decoupled") and not pod and rss >= 64 << 20:
            rec["target_memory"] = dst.post(f"/v1/checkpoints/{rec['id']}/reserve-memory", {"bytes": rss})
        state.result()
    where = f"address {', '.join(c['ips']) or 'none'}"
    if rec.get("keep_address") is False:
        ports = ", ".join(f"{p['host_port']}->{p['container_port']}" for p in rec.get("published") or [])
        where = f"published {ports or 'none'} (its address changes)"
    ctx.report(f"{c['name']} ({c['id'][:12]}) on {loc.node} -> {rec['target']}, {where}")


def probe_and_state(ctx: Ctx, loc: inventory.Located) -> None:
    """How the service is probed (``rec["probe"]``) and, for a heap server, the state it has now,
    which verify compares the copy with."""
    rec, c = ctx.rec, loc.container
    port = loc.port
    path_or_none: str | None = loc.probe_path or "/healthz"
    if rec["plan"].get("probe"):
        port, path_or_none = parse_probe(str(rec["plan"]["probe"]))
    host = c["ips"][0] if c["ips"] else None
    if port and rec.get("keep_address") is False:
        host, port = published.endpoint(ctx, loc.node, port)
    if port and host:
        rec["probe"] = {
            "host": host,
            "port": port,
            "path": path_or_none,
            "interval": rec["plan"]["probe_interval"],
        }
        if c["labels"].get(inventory.LABEL_KIND) == "stream-server":
            before = inventory.read_state(ctx.observer(), host, port)
            if before is not None:
                rec["state_before"] = before
