"""The migration controller: phases, their rollbacks, the record, and crash recovery.

A migration is an ordered list of phases chosen by mode and transport (``phases_for``); each list
reads as the table of contents of that kind of migration::

    stop-copy  validate -> checkpoint -> push -> pull | transfer -> restore -> cutover -> verify -> cleanup
    decoupled  the same, but the checkpoint leaves the source running and serving until cleanup
    cold       validate -> stop -> start (fresh, from the image) -> cutover -> verify -> cleanup

Each phase has a ``do`` and, where it changes something, an ``undo`` that works from the persisted
record alone (so a later process can run it) and is idempotent. If any phase before ``cleanup``
fails, the controller undoes every phase that started, newest first: the target's copy is removed,
the route goes back, and the source container is restored in place from the checkpoint that podman
kept (or, cold, started again). ``verify`` is the point of no return: only after the target
answered with the right state is the source removed. A record left ``running`` by a controller that
died is rolled back (or, past the point of no return, cleaned up) by ``recover``, which every
migrate command runs first.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podmigrate import layout
from podmigrate.client import AgentClient
from podmigrate.engine.blackout import blackout, counters_monotonic
from podmigrate.engine.record import Record, Store
from podmigrate.errors import AgentError, MigrationFailed, PodmigrateError, UsageError
from podmigrate.lab.cluster import Lab
from podmigrate.workload import manage

Report = Callable[[str], None]
MODES = ("stop-copy", "decoupled", "lazy", "cold")
# archive: podman's own --export / --import path with an agent-to-agent copy (a baseline)
TRANSPORTS = ("registry", "stream", "archive")


@dataclass
class Plan:
    workload: str
    target: str
    mode: str = "stop-copy"
    transport: str = "registry"
    compression: str = "none"  # registry transport: none (heaps do not compress), gzip, zstd
    tcp_established: bool = True
    # pods: checkpoint only these members; the others start fresh on the target (severs their loopback
    # connections with the checkpointed ones: the study's single-container finding). Empty: all.
    only: tuple[str, ...] = ()
    probe: str | None = None  # "http:PORT/PATH" or "tcp:PORT"; default: the container's labels
    probe_interval: float = 0.02
    verify_timeout: float = 120.0
    drain_timeout: float = 2.0  # decoupled with a draining router: connections open at the cutover


def parse_probe(spec: str) -> tuple[int, str | None]:
    """'http:8000/healthz' -> (8000, '/healthz'); 'tcp:5432' -> (5432, None)."""
    kind, _, rest = spec.partition(":")
    port, slash, path = rest.partition("/")
    if kind not in ("http", "tcp") or not port.isdigit() or not 0 < int(port) < 65536 or (kind == "tcp" and slash):
        raise UsageError(f"not a probe: {spec!r}", hint="use http:PORT/PATH (e.g. http:8000/healthz) or tcp:PORT")
    return int(port), (f"/{path}" if kind == "http" else None)


@dataclass
class Ctx:
    lab: Lab
    store: Store
    rec: Record
    report: Report
    clients: dict[str, AgentClient] = field(default_factory=dict)

    def agent(self, name: str) -> AgentClient:
        if name not in self.clients:
            self.clients[name] = self.lab.agent(name)
        return self.clients[name]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def save(self) -> None:
        self.store.save(self.rec)


def store_for(lab: Lab) -> Store:
    return Store(lab.dir / "state.db")


# ------------------------------------------------------------------------------------ phases
def validate(ctx: Ctx) -> None:
    rec = ctx.rec
    lab = ctx.lab
    loc = manage.locate(lab, rec["workload"])
    c = loc.container
    if c["pod"]:
        if rec["mode"] not in ("stop-copy", "decoupled"):
            raise UsageError(
                f"container {c['name']!r} belongs to a pod; pods move with --mode stop-copy or decoupled",
                hint="checkpointing one container of a pod alone would sever its loopback connections",
            )
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
    elif rec["plan"].get("only"):
        raise UsageError(f"{c['name']!r} is not in a pod; --only-container applies to pod members")
    if rec["target"] == loc.node:
        raise UsageError(
            f"{rec['workload']!r} already runs on {loc.node}",
            hint=f"pick another node: {', '.join(n for n in lab.nodes if n != loc.node)}",
        )
    if loc.others:
        where = ", ".join(f"{n} ({ci['state']})" for n, ci in loc.others)
        raise UsageError(
            f"stopped copies of {rec['workload']!r} are left on {where}",
            hint="remove them first: podmigrate lab exec NODE -- podman rm NAME",
        )
    rec.update(
        source=loc.node,
        container=rec["pod"]["name"] if rec.get("scope") == "pod" else c["name"],
        container_id=c["id"],
        image=c["image"],
        service_addresses=[ip for ip in c["ips"]],
    )
    for n in (loc.node, rec["target"]):
        info = ctx.agent(n).get("/v1/info")
        ver = tuple(int(x) for x in str(info.get("criu", "0")).split(".")[:2] if x.isdigit())
        if ver < (4, 2):
            raise PodmigrateError(
                f"{n} has CRIU {info.get('criu')}; 4.2 or newer is needed",
                hint="CRIU < 4.2 cannot dump sockets on kernels >= 6.16",
            )
        rec.setdefault("nodes", {})[n] = {k: info.get(k) for k in ("podman", "runc", "criu", "disk_free_bytes")}
    if rec["mode"] == "cold":
        rec["spec"] = ctx.agent(loc.node).get(f"/v1/containers/{c['name']}/spec")
    # The target needs the container's base image; fetching it now keeps it out of the blackout.
    rec["target_image"] = ctx.agent(rec["target"]).post("/v1/images", {"image": c["image"]})
    if rec["mode"] in ("stop-copy", "decoupled") and rec.get("scope") != "pod":
        # warm the target's memory for the restore now, outside the blackout (see the agent's
        # reserve-memory); small containers are not worth it
        rss = ctx.agent(loc.node).get(f"/v1/containers/{c['name']}/memory")["rss_bytes"]
        if rss >= 64 << 20:
            rec["target_memory"] = ctx.agent(rec["target"]).post(
                f"/v1/checkpoints/{rec['id']}/reserve-memory", {"bytes": rss}
            )
    port, path = loc.port, loc.probe_path or "/healthz"
    path_or_none: str | None = path
    if rec["plan"].get("probe"):
        port, path_or_none = parse_probe(rec["plan"]["probe"])
    if port and c["ips"]:
        rec["probe"] = {
            "host": c["ips"][0],
            "port": port,
            "path": path_or_none,
            "interval": ctx.rec["plan"]["probe_interval"],
        }
        if loc.container["labels"].get(manage.LABEL_KIND) == "stream-server":
            rec["state_before"] = manage.read_state(lab, c["ips"][0], port)
    ctx.report(
        f"{c['name']} ({c['id'][:12]}) on {loc.node} -> {rec['target']}, address {', '.join(c['ips']) or 'none'}"
    )


def start_probe(ctx: Ctx) -> None:
    if ctx.rec.get("probe"):
        ctx.rec["probe"]["id"] = ctx.agent("lan").post("/v1/probes", ctx.rec["probe"])["id"]
        # a few answers before the freeze, so that "last success before" exists
        time.sleep(0.1)


def checkpoint(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["source"]).post(
        f"/v1/containers/{rec['container']}/checkpoint",
        {
            "checkpoint_id": rec["id"],
            "tcp_established": rec["plan"]["tcp_established"],
            "leave_running": rec["mode"] == "decoupled",
            # streamed: pages go straight to the target's page server; a stop-copy source stays
            # frozen (not killed) until the target serves, as the copy to roll back to
            "page_server": rec.get("page_server"),
            "leave_stopped": rec.get("leave_stopped", False),
        },
    )
    rec["freeze_started"] = res["started"]
    rec["checkpoint_at"] = res["ended"]
    rec.setdefault("criu", {})["dump"] = res["stats"]
    rec.setdefault("bytes", {})["archive"] = res["archive_bytes"]
    if rec.get("page_server"):
        rec["bytes"]["pages"] = int(res["stats"].get("pages_written", 0)) * 4096


def undo_checkpoint(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    src = agent(rec["source"])
    ctrs = {c["name"]: c for c in src.get("/v1/containers")}
    c = ctrs.get(rec["container"])
    out = "source container untouched"
    if c and c["state"] == "running" and rec.get("leave_stopped"):
        res = src.post(f"/v1/containers/{rec['container']}/resume")
        out = f"resumed {rec['container']} on {rec['source']} ({len(res['woken'])} tasks, unlocked {res['unlocked']})"
    if c and c["state"] != "running":
        src.post(f"/v1/containers/{rec['container']}/restore", {"tcp_established": rec["plan"]["tcp_established"]})
        out = f"restored {rec['container']} in place on {rec['source']}"
    src.delete(f"/v1/checkpoints/{rec['id']}")
    return out


def push(ctx: Ctx) -> None:
    rec = ctx.rec
    from podmigrate.transport.registry import checkpoint_annotations

    ann = checkpoint_annotations(
        rec["container"], {"io.podmigrate.migration": rec["id"], "io.podmigrate.source-node": rec["source"]}
    )
    res = ctx.agent(rec["source"]).post(
        f"/v1/checkpoints/{rec['id']}/push",
        {"reference": rec["reference"], "annotations": ann, "compression": rec["plan"].get("compression", "none")},
    )
    rec["checkpoint_image"] = {k: res[k] for k in ("reference", "manifest_digest", "layer_digest")}
    rec["bytes"]["pushed"] = res["bytes"]


def undo_push(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    gone = agent(rec["source"]).post(
        "/v1/registry/delete", {"reference": rec["reference"], "checkpoint_id": rec["id"]}
    )["deleted"]
    return f"deleted {rec['reference']}" if gone else "no image to delete"


def pull(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["target"]).post(f"/v1/checkpoints/{rec['id']}/pull", {"reference": rec["reference"]})
    if res["layer_digest"] != rec["checkpoint_image"]["layer_digest"]:
        raise PodmigrateError(
            f"the registry served {res['layer_digest']} for {rec['reference']}, but "
            f"{rec['checkpoint_image']['layer_digest']} was pushed"
        )
    rec["bytes"]["pulled"] = res["bytes"]


def undo_pull(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    agent(rec["target"]).delete(f"/v1/checkpoints/{rec['id']}")
    return f"deleted the archive on {rec['target']}"


def transfer(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["source"]).post(f"/v1/checkpoints/{rec['id']}/send", {"node": rec["target"]})
    rec["bytes"]["sent"] = res["bytes"]
    rec["stream"] = {"sha256": res["sha256"], "seconds": round(res["ended"] - res["started"], 4)}


def pod_checkpoint(ctx: Ctx) -> None:
    rec = ctx.rec
    pod = rec["pod"]
    res = ctx.agent(rec["source"]).post(
        f"/v1/pods/{pod['name']}/checkpoint",
        {
            "checkpoint_id": rec["id"],
            "members": pod.get("checkpointed", pod["members"]),
            "tcp_established": rec["plan"]["tcp_established"],
            "leave_running": rec["mode"] == "decoupled",
        },
    )
    rec["freeze_started"] = res["started"]
    rec["checkpoint_at"] = res["ended"]
    rec.setdefault("criu", {})["dump"] = {m: r["stats"] for m, r in res["members"].items()}
    rec.setdefault("bytes", {})["archive"] = sum(r["archive_bytes"] for r in res["members"].values())


def undo_pod_checkpoint(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    src = agent(rec["source"])
    res = src.post(
        f"/v1/pods/{rec['pod']['name']}/restore-in-place",
        {"members": rec["pod"]["members"], "tcp_established": rec["plan"]["tcp_established"]},
    )
    src.delete(f"/v1/checkpoints/{rec['id']}")
    return f"restored {', '.join(res['restored']) or 'nothing'} in place in pod {rec['pod']['name']} on {rec['source']}"


def pod_transfer(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["source"]).post(
        f"/v1/checkpoints/{rec['id']}/send-pod",
        {"node": rec["target"], "members": rec["pod"].get("checkpointed", rec["pod"]["members"])},
    )
    rec["bytes"]["sent"] = res["bytes"]


def pod_restore(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["target"]).post(
        f"/v1/pods/{rec['pod']['name']}/restore",
        {
            "checkpoint_id": rec["id"],
            "members": rec["pod"].get("checkpointed", rec["pod"]["members"]),
            "fresh": rec["pod"].get("fresh", []),
            "mac": rec["pod"].get("mac"),
            "ip": rec["service_addresses"][0],
            "image": rec["image"],
            "tcp_established": rec["plan"]["tcp_established"],
        },
    )
    rec["criu"]["restore"] = res["members"]
    rec["restored_at"] = res["ended"]


def page_server(ctx: Ctx) -> None:
    rec = ctx.rec
    rec["page_server"] = ctx.agent(rec["target"]).post(f"/v1/checkpoints/{rec['id']}/page-server")
    rec["leave_stopped"] = rec["mode"] == "stop-copy"


def lazy_checkpoint(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["source"]).post(
        f"/v1/containers/{rec['container']}/checkpoint-lazy",
        {"checkpoint_id": rec["id"], "tcp_established": rec["plan"]["tcp_established"]},
    )
    rec["freeze_started"] = res["started"]
    rec["checkpoint_at"] = res["ended"]
    rec["lazy"] = {"address": res["address"], "port": res["port"]}
    # podman started, CRIU serving pages (the tasks frozen and dumped but for their memory), the
    # target's part packed
    rec["lazy"]["times"] = res.get("times", {})
    rec.setdefault("criu", {})["dump"] = res["stats"]
    rec.setdefault("bytes", {})["archive"] = res["archive_bytes"]


def undo_lazy_checkpoint(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    src = agent(rec["source"])
    res = src.post(f"/v1/checkpoints/{rec['id']}/abort-lazy")
    src.delete(f"/v1/checkpoints/{rec['id']}")
    c = {x["name"]: x for x in src.get("/v1/containers")}.get(rec["container"])
    if not c or c["state"] != "running":
        raise PodmigrateError(
            f"after aborting the lazy dump, {rec['container']} on {rec['source']} is {c['state'] if c else 'gone'}"
        )
    # CRIU thaws the tasks on that error path but leaves its network lock in place
    woke = src.post(f"/v1/containers/{rec['container']}/resume")
    return (
        f"the lazy dump gave up (exit {res.get('rc')}); {rec['container']} runs on {rec['source']}, "
        f"unlocked {woke['unlocked']}"
    )


def lazy_restore(ctx: Ctx) -> None:
    rec = ctx.rec
    # from now on what leaves the source on its LAN link is the pages the copy pulls (and a few probe
    # answers): lazy dumps have no page counts of their own (CRIU 4.2's stats-dump is empty for them)
    rec["lazy"]["lan_tx_before"] = ctx.agent(rec["source"]).get(f"/v1/checkpoints/{rec['id']}/lazy").get("lan_tx_bytes")
    res = ctx.agent(rec["target"]).post(
        f"/v1/checkpoints/{rec['id']}/restore-lazy",
        {
            **rec["lazy"],
            "image": rec["image"],
            "tcp_established": rec["plan"]["tcp_established"],
            # off only to measure what the waker saves (runtime/uffd.py)
            "wake_faults": os.environ.get("PODMIGRATE_LAZY_WAKE", "1") != "0",
        },
    )
    rec["lazy"]["wake_faults"] = res.get("wake_faults", False)
    rec["criu"]["restore"] = res["stats"]
    rec["restored_at"] = res["ended"]


def lazy_pages(ctx: Ctx) -> None:
    """Wait until every page has moved: the target's lazy-pages daemon and the source's dump end."""
    rec = ctx.rec
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        status = ctx.agent(rec["source"]).get(f"/v1/checkpoints/{rec['id']}/lazy")
        src = status.get("src", {})
        target = ctx.agent(rec["target"]).get(f"/v1/checkpoints/{rec['id']}/lazy")
        dst = target.get("dst", {})
        if not src.get("running") and not dst.get("running"):
            rec["lazy"].update(source_rc=src.get("rc"), daemon_rc=dst.get("rc"), all_pages_at=time.time())
            if target.get("waker"):
                rec["lazy"]["waker"] = target["waker"]
            before, after = rec["lazy"].get("lan_tx_before"), status.get("lan_tx_bytes")
            if before is not None and after is not None:
                rec.setdefault("bytes", {})["pages"] = after - before
            return
        time.sleep(0.1)
    raise PodmigrateError("the lazy page transfer did not finish within 30 minutes")


def stop(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["source"]).post(f"/v1/containers/{rec['container']}/stop", {"timeout": 2})
    rec["freeze_started"] = res["started"]


def undo_stop(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    src = agent(rec["source"])
    c = {x["name"]: x for x in src.get("/v1/containers")}.get(rec["container"])
    if c and c["state"] != "running":
        src.post(f"/v1/containers/{rec['container']}/start")
        return f"started {rec['container']} again on {rec['source']} (cold: its memory was lost)"
    return "source container untouched"


def start_fresh(ctx: Ctx) -> None:
    rec = ctx.rec
    spec = dict(rec["spec"])
    ctx.agent(rec["target"]).post("/v1/containers", spec)


def restore(ctx: Ctx) -> None:
    rec = ctx.rec
    res = ctx.agent(rec["target"]).post(
        f"/v1/checkpoints/{rec['id']}/restore",
        {"image": rec["image"], "tcp_established": rec["plan"]["tcp_established"]},
    )
    rec["criu"]["restore"] = res["stats"]
    rec["restored_at"] = res["ended"]
    ctrs = {c["name"]: c for c in ctx.agent(rec["target"]).get("/v1/containers")}
    new = ctrs.get(rec["container"])
    if not new or new["state"] != "running":
        raise PodmigrateError(f"{rec['container']} is not running on {rec['target']} after restore")
    if sorted(new["ips"]) != sorted(rec["service_addresses"]):
        raise PodmigrateError(
            f"{rec['container']} came back with addresses {new['ips']}, not {rec['service_addresses']}"
        )


def undo_restore(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    tgt = agent(rec["target"])
    if any(c["name"] == rec["container"] for c in tgt.get("/v1/containers")):
        tgt.delete(f"/v1/containers/{rec['container']}")
        return f"removed {rec['container']} from {rec['target']}"
    if rec.get("container_id"):  # a failed restore may have left storage under the container's ID
        tgt.delete(f"/v1/containers/{rec['container_id']}")
    return "nothing restored on the target"


def cutover(ctx: Ctx) -> None:
    rec = ctx.rec
    lan = ctx.agent("lan")
    # decoupled: the source still serves, so connections it holds may finish there (if the router
    # can drain); the other modes froze the source and their restored connections must move now
    drain = rec["mode"] == "decoupled"
    switches = [
        lan.put(f"/v1/routes/{ip}", {"via": layout.node_ip(rec["target"]), "drain": drain})
        for ip in rec["service_addresses"]
    ]
    rec["cutover"] = {
        "router": switches[0].get("router", "route") if switches else None,
        "switches": switches,
        "switch_s": round(sum(s["ended"] - s["started"] for s in switches), 6),
    }


def end_drain(ctx: Ctx) -> None:
    """Let connections still open on the source finish (bounded by ``drain_timeout``), then send
    everything to the target: called just before the source is retired."""
    rec = ctx.rec
    cut = rec.get("cutover") or {}
    draining = [s["addr"] for s in cut.get("switches", []) if s.get("draining")]
    if not draining:
        return
    lan = ctx.agent("lan")
    timeout = float(rec["plan"].get("drain_timeout", 2.0))
    cut["drain"] = [lan.post(f"/v1/routes/{ip}/drain", {"timeout": timeout}, timeout=timeout + 30) for ip in draining]


def undo_cutover(lab: Lab, rec: Record, agent: Callable[[str], AgentClient]) -> str:
    lan = agent("lan")
    for ip in rec["service_addresses"]:
        lan.put(f"/v1/routes/{ip}", {"via": layout.node_ip(rec["source"])})
    return f"routed {', '.join(rec['service_addresses'])} back to {rec['source']}"


def verify(ctx: Ctx) -> None:
    rec = ctx.rec
    probe = rec.get("probe")
    if probe and probe["path"]:
        url = f"http://{probe['host']}:{probe['port']}{probe['path']}"
        deadline = time.monotonic() + rec["plan"]["verify_timeout"]
        while not manage.lan_get(ctx.lab, url, timeout=2)["ok"]:
            if time.monotonic() > deadline:
                raise PodmigrateError(f"{rec['container']} does not answer at {url} on {rec['target']}")
            time.sleep(0.02)
        rec["first_answer_at"] = time.time()
    if probe and rec.get("state_before"):
        after = manage.read_state(ctx.lab, probe["host"], probe["port"])
        rec["state_after"] = after
        before = rec["state_before"]
        if after is None:
            raise PodmigrateError(f"{rec['container']} answers but /state fails on {rec['target']}")
        same_process = after.get("started") == before.get("started")
        checks = {
            "sha256_equal": after.get("sha256") == before.get("sha256"),
            "counter_not_backwards": after.get("counter", -1) >= before.get("counter", 0),
            "same_process_start": same_process,
        }
        rec["checks"] = checks
        if rec["mode"] == "cold":
            # by design: a fresh process from the image; the heap is regenerated from the same seed,
            # so its digest matches, but everything the process did (the counter) is gone
            rec["state"] = "lost" if not same_process else "kept"
        elif not all(checks.values()):
            raise PodmigrateError(
                f"state check failed after restore on {rec['target']}: {checks}",
                details={"before": before, "after": after},
            )
        else:
            rec["state"] = "kept"
    finish_probe(ctx)


def finish_probe(ctx: Ctx) -> None:
    rec = ctx.rec
    probe = rec.get("probe")
    if not probe or not probe.get("id") or "records" in probe:
        return
    lan = ctx.agent("lan")
    cut = rec.get("cutover", {}).get("switches", [{}])[-1].get("ended", time.time())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait for a few answers after the switch, then stop
        recs = lan.get(f"/v1/probes/{probe['id']}")
        if sum(1 for r in recs if r["ok"] and r["sent"] > cut) >= 3:
            break
        time.sleep(0.05)
    records = lan.delete(f"/v1/probes/{probe['id']}")
    log = ctx.lab.dir / "probes" / f"{rec['id']}.json"
    log.parent.mkdir(exist_ok=True)
    log.write_text(json.dumps(records))
    probe["log"] = str(log)
    start = float(rec.get("freeze_started") or rec["created"])
    b = blackout(records, start - 0.05, time.time())
    b["counters"] = counters_monotonic(records, cut)
    if rec.get("cutover"):
        b["at_cutover"] = blackout(records, rec["cutover"]["switches"][0]["started"] - 0.05, time.time())
    probe["records"] = len(records)
    rec["blackout"] = b
    if rec["mode"] == "decoupled":
        c = b["counters"]
        lost = (
            (c["max_before"] - c["min_after"]) if c["max_before"] is not None and c["min_after"] is not None else None
        )
        rec["drift"] = {"counter": lost, "since_checkpoint_s": round(cut - rec["checkpoint_at"], 4)}
    elif rec["mode"] in ("stop-copy", "lazy"):  # the copy resumes exactly where the source froze
        rec["drift"] = {"counter": 0, "since_checkpoint_s": 0.0}


def cleanup(ctx: Ctx) -> None:
    release_target_memory(ctx.rec, ctx.agent)
    rec = ctx.rec
    warnings: list[str] = []
    steps: tuple[tuple[str, Callable[[], object]], ...] = (
        ("drain", lambda: end_drain(ctx)),
        (
            "source container",
            lambda: ctx.agent(rec["source"]).post(
                f"/v1/containers/{rec['container']}/retire", {"ips": rec["service_addresses"]}
            ),
        ),
        ("source archive", lambda: ctx.agent(rec["source"]).delete(f"/v1/checkpoints/{rec['id']}")),
        ("target archive", lambda: ctx.agent(rec["target"]).delete(f"/v1/checkpoints/{rec['id']}")),
        (
            "registry image",
            lambda: ctx.agent(rec["target"]).post("/v1/registry/delete", {"reference": rec["reference"]}),
        ),
    )
    for what, fn in steps:
        try:
            fn()
        except PodmigrateError as e:
            warnings.append(f"{what}: {e.message}")
    if warnings:
        rec["cleanup_warnings"] = warnings


Undo = Callable[[Lab, Record, Callable[[str], AgentClient]], str]


@dataclass(frozen=True)
class Phase:
    name: str
    do: Callable[[Ctx], None]
    undo: Undo | None = None
    artifact: bool = False  # its undo only deletes a copy: a failed undo leaves a leftover, not a risk


VALIDATE = Phase("validate", validate)
CHECKPOINT = Phase("checkpoint", checkpoint, undo_checkpoint)
PUSH = Phase("push", push, undo_push, artifact=True)
PULL = Phase("pull", pull, undo_pull, artifact=True)
TRANSFER = Phase("transfer", transfer, undo_pull, artifact=True)
PAGE_SERVER = Phase("page-server", page_server, undo_pull, artifact=True)
RESTORE = Phase("restore", restore, undo_restore)
STOP = Phase("stop", stop, undo_stop)
START = Phase("start", start_fresh, undo_restore)
CUTOVER = Phase("cutover", cutover, undo_cutover)
VERIFY = Phase("verify", verify)
CLEANUP = Phase("cleanup", cleanup)
PHASES = {
    p.name: p
    for p in (VALIDATE, PAGE_SERVER, CHECKPOINT, PUSH, PULL, TRANSFER, RESTORE, STOP, START, CUTOVER, VERIFY, CLEANUP)
}
POINT_OF_NO_RETURN = "cleanup"
# the phases that start the probe: from here on the service may stop answering
PROBE_FROM = ("checkpoint", "stop")


# Post-copy: once the copy runs on the target, the source only serves pages and dies when they have
# all moved; from then on the target holds the only complete copy, so restore and cutover are not
# undone (a failure after them is finished forward, never rolled back onto a dying source).
LAZY_CHECKPOINT = Phase("checkpoint", lazy_checkpoint, undo_lazy_checkpoint)
# undone only when the restore itself failed (afterwards failures finish forward, see _run)
LAZY_RESTORE = Phase("restore", lazy_restore, undo_restore)
LAZY_CUTOVER = Phase("cutover", cutover)
LAZY_PAGES = Phase("pages", lazy_pages)


# Whole pods: every member is dumped and restored under one lock of the pod's network namespace, so
# their loopback connections (server <-> sidecar) survive; the pod comes back with its address.
POD_CHECKPOINT = Phase("checkpoint", pod_checkpoint, undo_pod_checkpoint)
POD_TRANSFER = Phase("transfer", pod_transfer, undo_pull, artifact=True)
POD_RESTORE = Phase("restore", pod_restore, undo_restore)


def phases_for(mode: str, transport: str, scope: str = "container") -> list[Phase]:
    if scope == "pod":
        return [VALIDATE, POD_CHECKPOINT, POD_TRANSFER, POD_RESTORE, CUTOVER, VERIFY, CLEANUP]
    if mode == "lazy":
        return [VALIDATE, LAZY_CHECKPOINT, TRANSFER, LAZY_RESTORE, LAZY_CUTOVER, VERIFY, LAZY_PAGES, CLEANUP]
    if mode == "cold":
        return [VALIDATE, STOP, START, CUTOVER, VERIFY, CLEANUP]
    if transport == "registry":
        return [VALIDATE, CHECKPOINT, PUSH, PULL, RESTORE, CUTOVER, VERIFY, CLEANUP]
    if transport == "archive":
        return [VALIDATE, CHECKPOINT, TRANSFER, RESTORE, CUTOVER, VERIFY, CLEANUP]
    # stream: memory pages flow into the target's CRIU page server during the dump; the rest of
    # the checkpoint (a few MB) follows agent to agent
    return [VALIDATE, PAGE_SERVER, CHECKPOINT, TRANSFER, RESTORE, CUTOVER, VERIFY, CLEANUP]


# ------------------------------------------------------------------------------------ running
def new_record(plan: Plan) -> Record:
    mid = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    return {
        "id": mid,
        "workload": plan.workload,
        "container": plan.workload,
        "source": None,
        "target": plan.target,
        "mode": plan.mode,
        "transport": {"cold": "none", "lazy": "stream"}.get(plan.mode, plan.transport),
        "status": "running",
        "phase": None,
        "phases": [],
        "rollbacks": [],
        "created": time.time(),
        "controller_pid": os.getpid(),
        "plan": plan.__dict__.copy(),
        "reference": f"{layout.REGISTRY}/podmigrate/checkpoints/{plan.workload.lower()}:{mid}",
    }


def migrate(lab: Lab, plan: Plan, report: Report = lambda _m: None) -> Record:
    """Run one migration; returns its record, or raises MigrationFailed after rolling back."""
    if plan.mode not in MODES:
        raise UsageError(f"unknown mode {plan.mode!r}", hint=f"modes: {', '.join(MODES)}")
    if plan.compression not in ("none", "gzip", "zstd"):
        raise UsageError(f"unknown compression {plan.compression!r}", hint="use none, gzip or zstd")
    if plan.compression != "none" and plan.transport != "registry":
        raise UsageError("compression applies to the registry transport only", hint="add --transport registry")
    if plan.mode != "cold" and plan.transport not in TRANSPORTS:  # cold moves no checkpoint
        raise UsageError(f"unknown transport {plan.transport!r}", hint=f"transports: {', '.join(TRANSPORTS)}")
    lab.require_up()
    if plan.target not in lab.nodes:
        raise UsageError(
            f"there is no node {plan.target!r} in lab {lab.name!r}", hint=f"its nodes are: {', '.join(lab.nodes)}"
        )
    store = store_for(lab)
    recover(lab, store, report)
    for other in store.list(status="running"):
        if other["workload"] == plan.workload:
            raise UsageError(
                f"{plan.workload!r} is already being migrated ({other['id']}, pid {other['controller_pid']})",
                hint="wait for it to finish",
            )
    ctx = Ctx(lab, store, new_record(plan), report)
    try:
        return _run(ctx)
    finally:
        ctx.close()


def _run(ctx: Ctx) -> Record:
    rec = ctx.rec
    try:
        phases = phases_for(rec["mode"], rec["transport"])
        i = 0
        while i < len(phases):
            phase = phases[i]
            i += 1
            name = phase.name
            rec["phase"] = name
            entry: dict[str, Any] = {"name": name, "started": time.time(), "ok": False}
            rec["phases"].append(entry)
            if name != "validate":  # a rejected request leaves no record behind
                ctx.save()
            if name in PROBE_FROM:
                start_probe(ctx)
                entry["started"] = time.time()
            phase.do(ctx)
            entry["ended"] = time.time()
            entry["ok"] = True
            ctx.save()
            ctx.report(f"✓ {name:<10} {entry['ended'] - entry['started']:7.3f} s")
            if name == "validate":  # what moves (a container or a whole pod) is known only now
                phases = phases_for(rec["mode"], rec["transport"], rec.get("scope", "container"))
    except Exception as e:
        err = e if isinstance(e, PodmigrateError) else PodmigrateError(f"{type(e).__name__}: {e}")
        rec["error"] = err.to_wire()
        if rec["phases"]:
            rec["phases"][-1]["ended"] = time.time()
        ctx.report(f"✗ {rec['phase']}: {err.message}")
        if rec["phase"] == "validate":
            raise
        _stop_probe_quietly(ctx)
        if rec["mode"] == "lazy" and any(p["name"] == "restore" and p["ok"] for p in rec["phases"]):
            rec["status"] = "failed"  # nothing to roll back to: the source only lives until its pages moved
            rec["hint"] = "the copy on the target is the only one; check it, then run `podmigrate gc`"
        else:
            rollback(ctx.lab, rec, ctx.agent, ctx.report)
        ctx.save()
        where = rec.get("source") or "its node"
        raise MigrationFailed(
            f"migration {rec['id']} of {rec['workload']!r} failed in phase {rec['phase']}: {err.message}; "
            + (
                "rolled back, it runs on " + where
                if rec["status"] == "rolled_back"
                else "ROLLBACK FAILED: see the record"
            ),
            hint=err.hint,
            details={"record": rec, **err.details},
        ) from e
    rec["status"] = "completed"
    summarize(rec)
    ctx.save()
    return rec


def _stop_probe_quietly(ctx: Ctx) -> None:
    probe = ctx.rec.get("probe") or {}
    if probe.get("id") and "records" not in probe:
        with contextlib.suppress(PodmigrateError):
            ctx.agent("lan").delete(f"/v1/probes/{probe['id']}")


def rollback(lab: Lab, rec: Record, agent: Callable[[str], AgentClient], report: Report) -> None:
    """Undo every phase that started, newest first; the record says what was done.

    An undo that only deletes a copy of the checkpoint (``Phase.artifact``) and fails leaves a
    leftover for ``leftovers`` (the workload is safe); any other failed undo means the workload's
    placement is uncertain, and the status becomes ``failed``.
    """
    failures = 0
    by_name = {p.name: p for p in phases_for(rec["mode"], rec["transport"], rec.get("scope", "container"))}
    for entry in reversed(rec["phases"]):
        phase = by_name[entry["name"]]
        if phase.undo is None:
            continue
        try:
            what = _undo_with_retry(phase, lab, rec, agent, report)
            rec["rollbacks"].append({"phase": phase.name, "ok": True, "did": what, "at": time.time()})
            report(f"↶ {phase.name:<10} {what}")
        except Exception as e:
            rec["rollbacks"].append({"phase": phase.name, "ok": False, "error": str(e), "at": time.time()})
            report(f"✗ undo {phase.name}: {e}")
            if phase.artifact:
                rec.setdefault("leftovers", []).append({"phase": phase.name, "error": str(e)})
            else:
                failures += 1
    release_target_memory(rec, agent)
    rec["status"] = "failed" if failures else "rolled_back"


def release_target_memory(rec: Record, agent: Callable[[str], AgentClient]) -> None:
    """Memory warmed for a restore that will not come (the agent also lets it go by itself)."""
    if rec.get("target_memory"):
        with contextlib.suppress(PodmigrateError):
            agent(rec["target"]).post(f"/v1/checkpoints/{rec['id']}/release-memory")


def _undo_with_retry(
    phase: Phase, lab: Lab, rec: Record, agent: Callable[[str], AgentClient], report: Report, patience: float = 60.0
) -> str:
    """An unreachable agent is usually one the lab is restarting: keep trying an undo that protects
    the workload (not a mere artifact deletion) for ``patience`` seconds before giving up."""
    assert phase.undo is not None
    deadline = time.monotonic() + (0 if phase.artifact else patience)
    while True:
        try:
            return phase.undo(lab, rec, agent)
        except AgentError as e:
            if time.monotonic() > deadline:
                raise
            report(f"… undo {phase.name}: {e.message}; retrying")
            time.sleep(1.0)


def recover(lab: Lab, store: Store, report: Report = lambda _m: None) -> list[Record]:
    """Finish what dead controllers left: roll back before the point of no return, clean up after."""
    done: list[Record] = []
    for rec in store.list(status="running"):
        pid = rec.get("controller_pid")
        if pid and pid != os.getpid() and os.path.exists(f"/proc/{pid}"):
            continue
        report(f"recovering migration {rec['id']} left in phase {rec['phase']} by a dead controller")
        ctx = Ctx(lab, store, rec, report)
        try:
            restored = any(p["name"] == "restore" and p["ok"] for p in rec["phases"])
            if rec["phase"] == POINT_OF_NO_RETURN or (rec["mode"] == "lazy" and restored):
                if rec["mode"] == "lazy":  # the target holds the only complete copy: finish forward
                    cutover(ctx)
                    lazy_pages(ctx)
                cleanup(ctx)
                rec["status"] = "completed"
            else:
                rollback(lab, rec, ctx.agent, report)
            rec["recovered_at"] = time.time()
            ctx.save()
            done.append(rec)
        finally:
            ctx.close()
    return done


def summarize(rec: Record) -> None:
    """Derive the headline figures from the phases."""
    ph = {p["name"]: p for p in rec["phases"]}
    rec["phase_s"] = {n: round(p["ended"] - p["started"], 4) for n, p in ph.items() if "ended" in p}
    b = rec.get("blackout")
    if b and b.get("first_ok_after"):
        rec["blackout_s"] = b["blackout_s"]
        rec["blackout_method"] = "probe"
    else:
        end = rec.get("first_answer_at") or ph["cutover"]["ended"]
        rec["blackout_s"] = round(end - rec["freeze_started"], 4)
        rec["blackout_method"] = "controller"
    if b and b.get("at_cutover"):
        rec["blackout_cutover_s"] = b["at_cutover"]["blackout_s"]
    nbytes = rec.get("bytes", {})
    # bytes that crossed the LAN: twice through the registry, once when streamed
    rec["bytes_moved"] = sum(nbytes.get(k, 0) for k in ("pushed", "pulled", "sent", "pages"))
    if nbytes.get("pages") and rec["mode"] == "lazy":  # from the restore until the last page arrived
        total = rec["lazy"]["all_pages_at"] - ph["restore"]["ended"]
        moved = nbytes["pages"]
    elif nbytes.get("pages"):  # the pages moved during the dump itself
        total = rec["phase_s"].get("checkpoint", 0) + rec["phase_s"].get("transfer", 0)
        moved = nbytes["pages"] + nbytes.get("sent", 0)
    else:
        total = sum(rec["phase_s"].get(p, 0) for p in ("push", "pull", "transfer"))
        moved = nbytes.get("archive", 0)
    rec["throughput_mb_s"] = round(moved / 2**20 / total, 1) if total else None
