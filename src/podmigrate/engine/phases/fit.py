"""Will the migration fit? Checked at validate, before anything is frozen, so a refusal costs nothing.

Each refusal says what is wrong and what to do:

- what a checkpoint cannot carry to another node: bind mounts and named volumes (their files stay on
  the source; CRIU would restore open files that are not there), host devices, published ports (the
  port is the source host's, and the target's may be taken), and a network other than the lab's
  ``mig`` (Podman's default NAT network has the same 10.88.0.0/16 on every node: the address is reachable
  from no other node and may be taken on the target);
- CRIU on the target older than the source's (a restore must read the images the dump wrote); another
  container runtime, or another major version of Podman, on the target (the checkpoint archive is
  Podman's own format: its config.dump and spec.dump are read by the Podman that restores); an older
  runc on the target is only a warning (runc hands the images to CRIU and reads just the OCI spec);
- the target's available memory (the restore writes the whole resident set) and free disk (CRIU's
  images land there, and the registry and archive transports write the archive on the source too:
  about twice the resident set, with a margin).
"""

from __future__ import annotations

from typing import Any

from podmigrate.engine.phases.context import Ctx
from podmigrate.engine.record import Record
from podmigrate.errors import UsageError

MARGIN = 256 << 20  # what the target keeps for itself beyond the copy


def version(v: Any) -> tuple[int, ...]:
    """(major, minor) of a version string like 4.2.1 (() when there is none)."""
    return tuple(int(x) for x in str(v or "0").split(".")[:2] if x.isdigit())


def check_spec(spec: dict[str, Any], name: str, network: str) -> None:
    """Refuse what cannot move with the container (from its ``/v1/containers/NAME/spec``); ``network``
    is the cluster's workload network, whose addresses move."""
    mounts = [m for m in spec.get("mounts") or [] if m.get("type") in ("bind", "volume")]
    if mounts:
        shown = ", ".join(f"{m['type']} {m.get('source') or '?'} -> {m['destination']}" for m in mounts)
        raise UsageError(
            f"{name!r} has {shown}: their files stay on the source node, so its copy would restore with files missing",
            hint="migrate containers that keep their state inside them (no bind mounts or volumes); a "
            "cold restart would not bring the files either",
        )
    if spec.get("devices"):
        raise UsageError(
            f"{name!r} uses host devices {spec['devices']}: the target's are other devices",
            hint="start it without --device to migrate it",
        )
    if spec.get("ports"):
        raise UsageError(
            f"{name!r} publishes ports {spec['ports']} on its node: they do not follow it, and the target's may be "
            "taken",
            hint="reach it at its address on the lab network instead (no -p); its address moves with it",
        )
    net = spec.get("network")
    if net and net != network and not spec.get("pod"):
        raise UsageError(
            f"{name!r} is on network {net!r}, not the cluster's {network!r}: its address is private "
            "to its node (Podman's default network has the same subnet everywhere)",
            hint=f"start it with --network {network} (podmigrate workload start does)",
        )


def check_runtimes(rec: Record, source: str, target: str) -> None:
    """The same runtime and Podman major version on both nodes; an older runc is a warning."""
    src, dst = rec["nodes"][source], rec["nodes"][target]
    a, b = src.get("capabilities", {}).get("runtime"), dst.get("capabilities", {}).get("runtime")
    if a and b and a != b:
        raise UsageError(
            f"{source} runs containers with {a} and {target} with {b}: a checkpoint is restored by the runtime "
            "that wrote it",
            hint=f"migrate to a node whose runtime is {a}",
        )
    if rec["mode"] == "cold":
        return
    if src.get("podman") and dst.get("podman") and version(src["podman"])[:1] != version(dst["podman"])[:1]:
        raise UsageError(
            f"{target} has Podman {dst['podman']} and {source} Podman {src['podman']}: another major version may "
            "not read the checkpoint archive this one writes",
            hint="run the same major version of Podman on both nodes, or restart it there with --mode cold",
        )
    if version(dst.get("runc")) < version(src.get("runc")):
        rec.setdefault("warnings", []).append(
            f"validate: {target} has runc {dst.get('runc')}, older than {source}'s {src.get('runc')}"
        )


def check_fit(ctx: Ctx, rss: int) -> None:
    """Versions between the nodes, and room on the target (and on the source for archive writers)."""
    rec = ctx.rec
    source, target = str(rec["source"]), str(rec["target"])
    src, dst = rec["nodes"][source], rec["nodes"][target]
    if version(dst.get("criu")) < version(src.get("criu")):
        raise UsageError(
            f"{target} has CRIU {dst.get('criu')}, older than {source}'s {src.get('criu')}: it may "
            "not read the images the dump writes",
            hint="upgrade CRIU on the target, or migrate the other way",
        )
    check_runtimes(rec, source, target)
    if src.get("cpuinfo") and dst.get("cpuinfo") and src["cpuinfo"] != dst["cpuinfo"]:
        why = ctx.agent(target).post("/v1/cpuinfo/check", {"image": src["cpuinfo"]})["why"]
        if why and rec["mode"] != "cold":
            raise UsageError(
                f"{target}'s CPU cannot run what was dumped on {source}'s (criu cpuinfo check: {why})",
                hint="migrate between nodes of the same CPU model, or restart it there with --mode cold",
            )
    if rec["mode"] == "cold":
        return
    avail = dst.get("mem_available_bytes")
    if avail is not None and rss + rss // 10 + MARGIN > avail:
        raise UsageError(
            f"{target} has {avail >> 20} MiB of memory available; the copy needs about "
            f"{(rss + rss // 10) >> 20} MiB plus {MARGIN >> 20} MiB to spare",
            hint="free memory on the target or pick another node",
        )
    need = 2 * rss + MARGIN
    # a restore of a parked checkpoint writes on the target alone (its source may be gone)
    writes_at_source = rec["transport"] in ("registry", "archive") and rec.get("scope") != "parked"
    writers = [target] + ([source] if writes_at_source else [])
    for node in writers:
        free = rec["nodes"][node].get("disk_free_bytes")
        if free is not None and need > free:
            raise UsageError(
                f"{node} has {free >> 20} MiB of disk free; this checkpoint needs about {need >> 20} MiB there",
                hint="free disk space on that node (podmigrate gc removes what failed migrations left)",
            )
