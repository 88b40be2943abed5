"""The node image: a debootstrapped Debian trixie rootfs with CRIU >= 4.2, Podman, runc, buildah,
skopeo, the distribution registry and nftables, built once and cached.

Nothing is installed on the host but debootstrap. CRIU comes from sid (trixie's 4.1.1 cannot dump
sockets on kernels >= 6.16), pinned at priority 100 and installed in a second apt run so that its
dependencies do not drag a sid libnftables into the image. The configuration files are rewritten on
every ``lab up`` (cheap), so changing them never forces a rebuild.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from podmigrate import layout
from podmigrate.errors import LabError, PreflightError
from podmigrate.lab import containerd, criu_build
from podmigrate.lab.host import Report
from podmigrate.runtime import speculative

SUITE = "trixie"
CRIU_SUITE = "sid"
MIRROR = os.environ.get("PODMIGRATE_MIRROR", "http://deb.debian.org/debian")
PACKAGES = [
    "podman",
    "runc",
    "conmon",
    "buildah",
    "skopeo",
    "netavark",
    "aardvark-dns",
    "catatonit",
    "iptables",
    "nftables",
    "iproute2",
    "procps",
    "psmisc",
    "util-linux",
    "docker-registry",
    "python3",
    "python3-cryptography",  # the agents seal checkpoints with AES-GCM (transport.seal)
    "mmdebstrap",
    "zstd",
    "jq",
    "curl",
    "ca-certificates",
    "uidmap",
    "fuse-overlayfs",
    "busybox-static",
    "checkpointctl",  # reads Podman's and containerd's checkpoint archives
]
# containerd 2.1 from sid too (trixie has 1.7): CRI restore exists from 2.1 to 2.3 (removed in 2.4); it
# depends only on runc and libc, so trixie's stay
CRIU_PACKAGES = [f"criu/{CRIU_SUITE}", f"libcriu2/{CRIU_SUITE}", f"libcompel1/{CRIU_SUITE}", f"containerd/{CRIU_SUITE}"]
MIN_CRIU = (4, 2)
CONTAINERD_RANGE = ((2, 1), (2, 4))

CONTAINERS_CONF = """\
[containers]
log_driver = "k8s-file"
pids_limit = 0            # the lab's cgroup2 tree has only the hugetlb controller
[engine]
runtime = "runc"          # crun 1.21 ignores the cgroup mode on restore (lab notes)
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
firewall_driver = "none"  # routing, no NAT: TCP 4-tuples survive a migration
"""
# runc hands this file to CRIU after its own options, so it wins. It must say "manage-cgroups=ignore"
# with "=": "manage-cgroups ignore" parses as --manage-cgroups plus a stray word. network-lock=nftables:
# CRIU locks and unlocks the container's network with libnftables in its own process; its default,
# iptables, runs iptables-restore twice to lock and five processes to unlock, some 50 ms of every
# restore's blackout here (engine.paths "iptables-network-lock"). A restore uses the dump's method.
CRIU_RUNC_CONF = "manage-cgroups=ignore\nskip-in-flight\nnetwork-lock=nftables\n"
REGISTRIES_CONF = f'[[registry]]\nlocation = "{layout.REGISTRY}"\ninsecure = true\n'


def spec_hash() -> str:
    words = [SUITE, MIRROR, *PACKAGES, *CRIU_PACKAGES, criu_build.spec()]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


class NodeImage:
    def __init__(self, root: Path):
        self.root = root
        self.marker = root / ".podmigrate-image"

    def ready(self) -> bool:
        try:
            return self.marker.read_text().strip() == spec_hash()
        except OSError:
            return False

    def _log(self, name: str) -> Path:
        return self.root.parent / f"{name}.log"

    def _run(self, argv: list[str], step: str) -> None:
        log = self._log(step)
        with open(log, "w") as f:
            p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT)
        if p.returncode:
            tail = log.read_text(errors="replace").splitlines()[-25:]
            raise LabError(
                f"building the node image failed at '{step}' (exit {p.returncode})",
                hint=f"full log: {log}; a network problem is the usual cause: run `lab up` again",
                details={"log_tail": tail},
            )

    def chroot_script(self, script: str, step: str) -> None:
        """Run a shell script chrooted in the image, in a private mount namespace with /proc."""
        wrapper = (
            f"set -e; mount -t proc proc '{self.root}/proc'; "
            f"export DEBIAN_FRONTEND=noninteractive LC_ALL=C PATH={layout.LAB_PATH}; "
            f"chroot '{self.root}' /bin/sh -ec \"$0\""
        )
        self._run(["unshare", "-m", "--propagation", "private", "sh", "-c", wrapper, script], step)

    def build(self, report: Report) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        if (self.root / "debootstrap").exists():
            # debootstrap removes its work directory only when it finished: this one was interrupted,
            # and what it left cannot be trusted (a later apt-get on it fails, or worse, works half)
            report(f"removing an interrupted debootstrap in {self.root}")
            shutil.rmtree(self.root)
        if not (self.root / "usr/bin/apt-get").exists():
            report(f"debootstrap {SUITE} (about a minute)")
            self._run(["debootstrap", "--variant=minbase", SUITE, str(self.root), MIRROR], "debootstrap")
        (self.root / "etc/apt/sources.list").write_text(f"deb {MIRROR} {SUITE} main\n")
        (self.root / f"etc/apt/sources.list.d/{CRIU_SUITE}.list").write_text(f"deb {MIRROR} {CRIU_SUITE} main\n")
        (self.root / f"etc/apt/preferences.d/{CRIU_SUITE}").write_text(
            f"Package: *\nPin: release n={CRIU_SUITE}\nPin-Priority: 100\n"
        )
        (self.root / "etc/resolv.conf").unlink(missing_ok=True)
        (self.root / "etc/resolv.conf").write_bytes(Path("/etc/resolv.conf").read_bytes())
        report("installing podman, buildah, registry, nftables (apt, a few minutes)")
        # Check-Valid-Until=false: some mirrors serve an expired sid Release file
        self.chroot_script(
            "apt-get -o Acquire::Check-Valid-Until=false update -q; "
            f"apt-get install -y -q --no-install-recommends {' '.join(PACKAGES)}",
            "apt-install",
        )
        report(f"installing CRIU and containerd from {CRIU_SUITE}")
        self.chroot_script(
            f"apt-get install -y -q --no-install-recommends {' '.join(CRIU_PACKAGES)}; apt-get clean", "apt-criu"
        )
        version = self.criu_version()
        if version < MIN_CRIU:
            raise PreflightError(
                f"the node image has CRIU {version}, but {MIN_CRIU} or newer is needed",
                hint="CRIU < 4.2 cannot dump sockets on kernels >= 6.16",
            )
        have = self.containerd_version()
        if not CONTAINERD_RANGE[0] <= have[:2] < CONTAINERD_RANGE[1]:
            raise PreflightError(
                f"the node image has containerd {have}; 2.1 to 2.3 is needed",
                hint="containerd 2.4 removed restore through CRI CreateContainer",
            )
        report(f"building podmigrate's CRIU ({criu_build.VERSION} and its patch; a minute or two)")
        criu_build.build(self.root, self.root.parent / "criu", MIRROR, self._run)
        self.marker.write_text(spec_hash())

    def criu_version(self) -> tuple[int, ...]:
        p = subprocess.run(["chroot", str(self.root), "/usr/sbin/criu", "--version"], capture_output=True, text=True)
        for line in p.stdout.splitlines():
            if line.startswith("Version:"):
                return tuple(int(x) for x in line.split()[1].split(".")[:2])
        return (0,)

    def containerd_version(self) -> tuple[int, ...]:
        p = subprocess.run(["chroot", str(self.root), "containerd", "--version"], capture_output=True, text=True)
        words = p.stdout.split()  # containerd github.com/containerd/containerd/v2 2.1.9+unknown
        try:
            return tuple(int(x) for x in words[2].split("+")[0].split(".")[:3])
        except (IndexError, ValueError):
            return (0,)

    def configure(self) -> None:
        """Write the runtime configuration and the mount points the lab needs (idempotent)."""
        r = self.root
        for d in (
            "oldroot",
            "opt/podmigrate/podmigrate",
            layout.IN_LAB_STATE[1:],
            layout.IN_LAB_CACHE[1:],
            layout.NODE_CHECKPOINTS[1:],
            "etc/criu",
            "etc/containers/registries.conf.d",
            "etc/containers/networks",
        ):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "etc/criu/runc.conf").write_text(CRIU_RUNC_CONF)
        for f in ("etc/criu/default.conf", "etc/criu/crun.conf"):
            (r / f).unlink(missing_ok=True)
        (r / "etc/containers/containers.conf").write_text(CONTAINERS_CONF)
        # runc finds the speculative restore's gate first in its PATH (runtime.speculative)
        gate = r / speculative.CRIU_GATE_PATH.lstrip("/")
        gate.parent.mkdir(parents=True, exist_ok=True)
        criu = criu_build.BINARY if criu_build.installed(r) else "/usr/sbin/criu"
        gate.write_text(speculative.criu_gate(criu=criu))
        gate.chmod(0o755)
        (r / "etc/containers/registries.conf.d/50-podmigrate.conf").write_text(REGISTRIES_CONF)
        containerd.install_wrapper(r)
