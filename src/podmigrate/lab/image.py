"""The node image: a debootstrapped Debian trixie rootfs with CRIU >= 4.2, Podman, runc, buildah,
skopeo, the distribution registry and nftables, built once per spec and cached.

Nothing is installed on the host but debootstrap. The packages come from the host's own Debian
mirror (``mirror``). CRIU comes from sid (trixie's 4.1.1 cannot dump sockets on kernels >= 6.16),
pinned at priority 100 and installed in a second apt run so that its dependencies do not drag a sid
libnftables into the image.

Each spec (``spec_hash``) is its own directory, built once under a lock and never written again
(``image_store``): labs running on one version never see it change under them. The runtime
configuration (CRIU's options for runc, Podman's, the registry's, the CRIU gate, containerd's
wrappers) is not in the image: each lab writes its own into its state directory (``stage_config``)
and STAGE1 (``lifecycle``) bind-mounts it over the image's placeholders, so changing it never
forces a rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from podmigrate import layout
from podmigrate.errors import LabError, PreflightError
from podmigrate.lab import containerd, criu_build, host, mirror
from podmigrate.lab.host import Report
from podmigrate.lab.image_store import ImageStore
from podmigrate.runtime import speculative

SUITE = "trixie"
CRIU_SUITE = "sid"
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
    "etcd-server",  # the store of the lab's Kubernetes control plane (podmigrate.kube): 3.5.16 >= 3.5.11
    "containernetworking-plugins",  # the pods' bridge network under the upstream kubelet
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
FIREWALLS = {  # the containers.conf line of each firewall a lab's Podman can have (``lab up --firewall``)
    "none": 'firewall_driver = "none"  # routing, no NAT: TCP 4-tuples survive a migration',
    # as on a plain host: NAT and published ports (``lab.hosts_view``); the lab's own routed
    # migrations are not for such a lab (a restored connection's packets would be masqueraded)
    "nftables": 'firewall_driver = "nftables"  # NAT and published ports, as on a plain host (lab inventory)',
}
# runc hands this file to CRIU after its own options, so it wins. It must say "manage-cgroups=ignore"
# with "=": "manage-cgroups ignore" parses as --manage-cgroups plus a stray word. network-lock=nftables:
# CRIU locks and unlocks the container's network with libnftables in its own process; its default,
# iptables, runs iptables-restore twice to lock and five processes to unlock, some 50 ms of every
# restore's blackout here (engine.paths "iptables-network-lock"). A restore uses the dump's method.
CRIU_RUNC_CONF = "manage-cgroups=ignore\nskip-in-flight\nnetwork-lock=nftables\n"
REGISTRIES_CONF = f'[[registry]]\nlocation = "{layout.REGISTRY}"\ninsecure = true\n'


# Mount points the lab and its nodes bind over, created in the image when it is built
MOUNT_DIRS = (
    "oldroot",
    "opt/podmigrate/podmigrate",
    layout.IN_LAB_STATE[1:],
    layout.IN_LAB_CACHE[1:],
    layout.NODE_CHECKPOINTS[1:],
    "etc/criu",
    "etc/containers/registries.conf.d",
    "etc/containers/networks",
)
# The lab's runtime configuration (``stage_config``): empty placeholders in the image, each lab's own
# files bind-mounted over them at its start
MOUNT_FILES = (
    "etc/criu/runc.conf",
    "etc/containers/containers.conf",
    "etc/containers/registries.conf.d/50-podmigrate.conf",
    speculative.CRIU_GATE_PATH[1:],
    containerd.RUNC_NOCG[1:],
    containerd.RESTORE_RUNC[1:],
    "etc/podmigrate/runc-restore.json",
)
# CRIU reads default.conf on every run (page servers and lazy-pages daemons too), crun its crun.conf:
# no options but the ones podmigrate passes and runc.conf's
CRIU_CONF_DROPPED = ("etc/criu/default.conf", "etc/criu/crun.conf")


def packages_hash() -> str:
    """What is installed, from where: also the marker of the old layout's image (``image_store``)."""
    words = [SUITE, mirror.debian_mirror(), *PACKAGES, *CRIU_PACKAGES, criu_build.spec()]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


def spec_hash() -> str:
    """The image's version: what is installed and the mount points the lab needs in it."""
    words = [packages_hash(), *MOUNT_DIRS, *MOUNT_FILES, *CRIU_CONF_DROPPED]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


def prepare_mount_points(root: Path) -> None:
    """The last step of a build (or of adopting an old-layout image): mount points, no configuration."""
    for d in MOUNT_DIRS:
        (root / d).mkdir(parents=True, exist_ok=True)
    for f in MOUNT_FILES:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).touch()
    for f in CRIU_CONF_DROPPED:
        (root / f).unlink(missing_ok=True)


class NodeImage:
    """The node image of one ``PODMIGRATE_HOME``: its versions in ``<home>/node-image/<version>``."""

    def __init__(self, root: Path):
        # ``root`` is the old layout's one image, <home>/node-image/rootfs: versions live beside it
        store = Path(os.path.abspath(root.parent))
        self.store = ImageStore(store, store.parent / "labs", host.holder_pid)
        self._root: Path | None = None

    @property
    def root(self) -> Path:
        """The rootfs this lab runs on: the one ``ensure`` returned, else the current spec's."""
        return self._root or self.store.rootfs(spec_hash())

    def ready(self) -> bool:
        return self.store.ready(spec_hash())

    def ensure(self, report: Report) -> Path:
        """The current spec's rootfs: ready, adopted from the old layout, or built now."""
        version = spec_hash()
        if not self.store.ready(version):
            report(f"the node image {version} is not built yet: building it (or waiting for its builder)")
        self._root = self.store.ensure(
            version,
            lambda root: self._build(root, report),
            report,
            adopt=(packages_hash(), prepare_mount_points),
        )
        self.store.touch(version)
        return self._root

    @contextlib.contextmanager
    def use(self, report: Report) -> Iterator[Path]:
        """``ensure``, and keep the version from removal until the block ends (a lab starting on it)."""
        with self.store.use():
            yield self.ensure(report)

    def collect(self, report: Report) -> list[str]:
        """Remove old versions no lab up uses (``image_store.ImageStore.collect``)."""
        return self.store.collect(spec_hash(), report)

    def stage_config(self, dest: Path, firewall: str = "none") -> list[str]:
        """Write a lab's runtime configuration into ``dest`` (its state directory), laid out as in the
        image; the paths, relative to /, that STAGE1 bind-mounts over the image's placeholders.
        ``firewall``: Podman's (netavark's) firewall driver, ``none`` or ``nftables`` (``FIREWALLS``)."""
        shutil.rmtree(dest, ignore_errors=True)
        for d in ("etc/criu", "etc/containers/registries.conf.d", "usr/local/sbin"):
            (dest / d).mkdir(parents=True, exist_ok=True)
        (dest / "etc/criu/runc.conf").write_text(CRIU_RUNC_CONF)
        (dest / "etc/containers/containers.conf").write_text(
            CONTAINERS_CONF.replace(FIREWALLS["none"], FIREWALLS[firewall])
        )
        (dest / "etc/containers/registries.conf.d/50-podmigrate.conf").write_text(REGISTRIES_CONF)
        # runc finds the speculative restore's gate first in its PATH (runtime.speculative)
        gate = dest / speculative.CRIU_GATE_PATH[1:]
        criu = criu_build.BINARY if criu_build.installed(self.root) else "/usr/sbin/criu"
        gate.write_text(speculative.criu_gate(criu=criu))
        gate.chmod(0o755)
        containerd.install_wrapper(dest)
        written = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
        if written != sorted(MOUNT_FILES):
            raise LabError(
                f"the lab's configuration files {written} are not the image's mount points {sorted(MOUNT_FILES)}",
                hint="add the new file to lab.image.MOUNT_FILES (a new image version has its placeholder)",
            )
        return list(MOUNT_FILES)

    # ------------------------------------------------------------------ the build
    def _log(self, name: str) -> Path:
        # one builder at a time (the store's lock), so the last build's logs keep fixed names
        return self.store.path / f"{name}.log"

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

    def chroot_script(self, root: Path, script: str, step: str) -> None:
        """Run a shell script chrooted in ``root``, in a private mount namespace with /proc."""
        wrapper = (
            f"set -e; mount -t proc proc '{root}/proc'; "
            f"export DEBIAN_FRONTEND=noninteractive LC_ALL=C PATH={layout.LAB_PATH}; "
            f"chroot '{root}' /bin/sh -ec \"$0\""
        )
        self._run(["unshare", "-m", "--propagation", "private", "sh", "-c", wrapper, script], step)

    def _build(self, root: Path, report: Report) -> None:
        """Build the image into ``root``, a fresh empty directory (``image_store`` publishes it)."""
        url = mirror.debian_mirror()
        root.chmod(0o755)  # it becomes the lab's /, whatever the umask
        report(f"debootstrap {SUITE} from {url} (about a minute)")
        self._run(["debootstrap", "--variant=minbase", SUITE, str(root), url], "debootstrap")
        (root / "etc/apt/sources.list").write_text(f"deb {url} {SUITE} main\n")
        (root / f"etc/apt/sources.list.d/{CRIU_SUITE}.list").write_text(f"deb {url} {CRIU_SUITE} main\n")
        (root / f"etc/apt/preferences.d/{CRIU_SUITE}").write_text(
            f"Package: *\nPin: release n={CRIU_SUITE}\nPin-Priority: 100\n"
        )
        (root / "etc/resolv.conf").unlink(missing_ok=True)
        (root / "etc/resolv.conf").write_bytes(Path("/etc/resolv.conf").read_bytes())
        report("installing podman, buildah, registry, nftables (apt, a few minutes)")
        # Check-Valid-Until=false: some mirrors serve an expired sid Release file
        self.chroot_script(
            root,
            "apt-get -o Acquire::Check-Valid-Until=false update -q; "
            f"apt-get install -y -q --no-install-recommends {' '.join(PACKAGES)}",
            "apt-install",
        )
        report(f"installing CRIU and containerd from {CRIU_SUITE}")
        self.chroot_script(
            root,
            f"apt-get install -y -q --no-install-recommends {' '.join(CRIU_PACKAGES)}; apt-get clean",
            "apt-criu",
        )
        version = criu_version(root)
        if version < MIN_CRIU:
            raise PreflightError(
                f"the node image has CRIU {version}, but {MIN_CRIU} or newer is needed",
                hint="CRIU < 4.2 cannot dump sockets on kernels >= 6.16",
            )
        have = containerd_version(root)
        if not CONTAINERD_RANGE[0] <= have[:2] < CONTAINERD_RANGE[1]:
            raise PreflightError(
                f"the node image has containerd {have}; 2.1 to 2.3 is needed",
                hint="containerd 2.4 removed restore through CRI CreateContainer",
            )
        report(f"building podmigrate's CRIU ({criu_build.VERSION} and its patches; a minute or two)")
        criu_build.build(root, self.store.path / "criu", url, self._run)
        prepare_mount_points(root)


def criu_version(root: Path) -> tuple[int, ...]:
    p = subprocess.run(["chroot", str(root), "/usr/sbin/criu", "--version"], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("Version:"):
            return tuple(int(x) for x in line.split()[1].split(".")[:2])
    return (0,)


def containerd_version(root: Path) -> tuple[int, ...]:
    p = subprocess.run(["chroot", str(root), "containerd", "--version"], capture_output=True, text=True)
    words = p.stdout.split()  # containerd github.com/containerd/containerd/v2 2.1.9+unknown
    try:
        return tuple(int(x) for x in words[2].split("+")[0].split(".")[:3])
    except (IndexError, ValueError):
        return (0,)
