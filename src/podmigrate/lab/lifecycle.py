"""Bringing a lab up and taking it down: the node image, the lab holder's start, and the teardown.

``up`` and ``down`` act on a ``cluster.Lab`` (whose methods of the same names call them); ``host``
has the cgroup and process helpers, ``image`` the node image. The test workload's image is not
built here: ``workload.image.ready_lab`` adds it after ``up``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import podmigrate
from podmigrate import layout, procs
from podmigrate.claims import Claims
from podmigrate.errors import LabError, PreflightError, UsageError
from podmigrate.lab import host, image, preflight, tunables
from podmigrate.lab.host import Report
from podmigrate.pki import CA

if TYPE_CHECKING:
    from podmigrate.lab.cluster import Lab

# Stage 1 runs on the host's tools inside a fresh private mount namespace: bind the node image and
# the lab's directories into place, the lab's own configuration (K: lab.image.stage_config, then its
# files) over the image's placeholders, pivot into the image, and hand over to the lab holder.
STAGE1 = """\
set -e
R=$1 L=$2 C=$3 P=$4 K=$5
shift 5
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount --rbind /dev "$R/dev"
mount --rbind /sys "$R/sys"
mount --bind "$L" "$R/var/lib/podmigrate-lab"
mount --bind "$C" "$R/var/lib/podmigrate-cache"
mount --bind "$P" "$R/opt/podmigrate/podmigrate"
mount -o remount,bind,ro "$R/opt/podmigrate/podmigrate"
for f in "$@"; do
    mount --bind "$K/$f" "$R/$f"
    mount -o remount,bind,ro "$R/$f"
done
cd "$R"
pivot_root . oldroot
cd /
exec env -i PATH={path} HOME=/root LC_ALL=C.UTF-8 PYTHONPATH=/opt/podmigrate PYTHONDONTWRITEBYTECODE=1 \
    python3 -m podmigrate.lab.init lab
""".replace("{path}", layout.LAB_PATH)

REGISTRY_YML = f"""\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {layout.IN_LAB_STATE}/registry
  delete:
    enabled: true
http:
  addr: {layout.REGISTRY}
"""


RUNTIMES = ("podman", "containerd")
FIREWALLS = tuple(image.FIREWALLS)


def up(
    lab: Lab, nodes: int, report: Report, router: str | None, runtime: str = "podman", firewall: str = "none"
) -> dict[str, Any]:
    if runtime not in RUNTIMES:
        raise UsageError(f"unknown runtime {runtime!r}", hint=f"runtimes: {', '.join(RUNTIMES)}")
    if firewall not in FIREWALLS:
        raise UsageError(f"unknown firewall {firewall!r}", hint=f"firewalls: {', '.join(FIREWALLS)}")
    names = layout.node_names(nodes)
    notes = preflight.check_host(lab.base)
    for n in notes:
        report(n)
    if lab.is_up():
        have = lab.nodes
        if have != names:
            raise UsageError(
                f"lab {lab.name!r} is already up with {len(have)} nodes, not {nodes}",
                hint="run `podmigrate lab down` first to change the node count",
            )
        for key, want, default in (("runtime", runtime, "podman"), ("firewall", firewall, "none")):
            if (have_it := lab.config().get(key, default)) != want:
                raise UsageError(
                    f"lab {lab.name!r} is already up with {key} {have_it}, not {want}",
                    hint=f"run `podmigrate lab down` first to change the {key}",
                )
        report(f"lab {lab.name!r} is already up")
    else:
        if lab.dir.exists() or lab.cgroup.exists():
            report("removing what a previous lab left behind")
            down(lab)
        # the image version cannot be removed from when it is picked until the lab is up on it
        with lab.image.use(report):
            start(lab, names, report, runtime, firewall)
        lab.image.collect(report)
        report("checking CRIU against this kernel (criu check on node-a)")
        check = lab.run(names[0], ["criu", "check"], check=False)
        if check.returncode:
            down(lab)
            raise PreflightError(
                "`criu check` fails on this machine: CRIU cannot checkpoint here",
                hint="its output is below; the kernel may lack a feature CRIU needs",
                details={"output": (check.stdout + check.stderr).splitlines()[-20:]},
            )
    if router:
        lab.set_router(router)
    return lab.status()


def issue_identities(lab: Lab, names: list[str]) -> None:
    """The lab's CA and a certificate per node (its LAN address), for the LAN agent and for the
    controller: agents know each other by these, never by a shared secret (``agent.tls``)."""
    ca = CA(lab.dir / "pki", f"lab {lab.name}")
    for n in names:
        ca.issue(n, ips=[layout.node_ip(n)])
    ca.issue("lan", ips=[layout.LAN_GATEWAY])
    ca.issue("controller")


def start(lab: Lab, names: list[str], report: Report, runtime: str = "podman", firewall: str = "none") -> None:
    report(f"starting lab {lab.name!r} with nodes {', '.join(names)}")
    lab.dir.mkdir(parents=True, exist_ok=True)
    # machine-wide kernel settings (the nodes share this kernel): kept, and put back by the last `lab down`
    for change in tunables.acquire(lab.dir, _is_up, legacy=lab.base):
        report(f"machine setting for the lab: {change}")
    os.chmod(lab.dir, 0o700)  # checkpoints and the token live below
    lab.cache.mkdir(parents=True, exist_ok=True)
    for d in ("pids", "agents", "logs", "hold", "registry", "nodes"):
        (lab.dir / d).mkdir(exist_ok=True)
    config = lab.dir / "image-config"
    config_files = lab.image.stage_config(config, firewall)  # the image is never written: STAGE1 mounts these over it
    fd = os.open(lab.dir / "token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    issue_identities(lab, names)
    (lab.dir / "registry.yml").write_text(REGISTRY_YML)
    (lab.dir / "lab.json").write_text(
        json.dumps(
            {
                "name": lab.name,
                "nodes": names,
                "runtime": runtime,  # podman alone, or containerd (with its CRI socket) beside it
                "firewall": firewall,  # Podman's: none (routed addresses), or nftables (NAT, published ports)
                "cgroup": layout.cgroup_name(lab.name, str(lab.base)),
                "created": time.time(),
                "version": podmigrate.__version__,
                "image": str(lab.image.root),  # kept while a lab is up on it (lab.image_store)
            }
        )
    )
    (lab.cgroup / "lab").mkdir(parents=True, exist_ok=True)
    pkg = Path(podmigrate.__file__).resolve().parent
    log = open(lab.dir / "logs" / "lab.log", "ab")
    proc = subprocess.Popen(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            STAGE1,
            "stage1",
            str(lab.image.root),
            str(lab.dir),
            str(lab.cache),
            str(pkg),
            str(config),
            *config_files,
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=host.join(lab.cgroup / "lab"),
    )
    log.close()
    procs.write_pidfile(lab.dir / "lab.pid", proc.pid)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if lab.is_up():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = (lab.dir / "logs" / "lab.log").read_text(errors="replace").splitlines()[-30:]
    down(lab)
    raise LabError(
        f"lab {lab.name!r} failed to start",
        details={"log_tail": tail},
        hint="the log tail is above; `podmigrate lab up` again after fixing the cause",
    )


def _is_up(lab_dir: Path) -> bool:
    return host.holder_pid(lab_dir) is not None


def down(lab: Lab, report: Report = lambda _m: None) -> None:
    Claims(lab.dir).refuse_if_busy(f"take lab {lab.name!r} down")  # it would kill the migration's agents mid-way
    cg = lab.cgroup
    if cg.exists():
        report(f"stopping every process of lab {lab.name!r}")
        (cg / "cgroup.kill").write_text("1")
        # cgroup.procs empties before the tasks are gone; "populated 0" means really gone
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "populated 1" in (cg / "cgroup.events").read_text():
            time.sleep(0.05)
        host.reap(lab.dir / "lab.pid")
        left = host.cgroup_pids(cg)
        if left:
            raise LabError(f"processes of lab {lab.name!r} survived cgroup.kill: {left[:10]}")
        for d in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            host.rmdir(d)
        host.rmdir(cg)
    labs = lab.base / "labs"
    tunables.release(
        lab.dir,
        _is_up,
        unregistered=lambda: [
            str(d)
            for d in (labs.iterdir() if labs.is_dir() else ())
            if d != lab.dir and host.NAME.fullmatch(d.name) and _is_up(d)
        ],
    )
    if lab.dir.exists():
        report(f"removing {lab.dir}")
        shutil.rmtree(lab.dir)
