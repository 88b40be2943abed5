"""Builds the workload image offline: a Debian trixie rootfs with python3 + numpy (mmdebstrap),
stream-server, the sidecar and the background load's mesh service on top, FROM scratch with buildah.

Both steps are cached in ``$PODMIGRATE_HOME/cache``: the rootfs by its package list, the OCI archive
by the hash of that plus the workload's sources. A new lab only copies the archive into its registry
(skopeo), a few seconds. Labs share the cache and may build at once: each writes under a name of its
own and renames the result into place, so a reader finds a complete file or none.

The lab (``podmigrate.lab``) knows nothing of this image: ``manage.start`` ensures it before a start,
and ``ready_lab`` is ``lab up`` followed by loading it, for those who want a lab ready at once.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate import layout
from podmigrate.lab import mirror
from podmigrate.lab.image import SUITE

if TYPE_CHECKING:
    from podmigrate.lab.cluster import Lab, Report

HERE = Path(__file__).resolve().parent
SOURCES = ("heapsrv.py", "sidecar.py", "mesh.py")
ROOTFS_PACKAGES = "python3,python3-numpy"
REPOSITORY = f"{layout.REGISTRY}/podmigrate/stream-server"


def image_tag() -> str:
    h = hashlib.sha256(f"{SUITE} {mirror.debian_mirror()} {ROOTFS_PACKAGES}".encode())
    for s in SOURCES:
        h.update((HERE / s).read_bytes())
    return h.hexdigest()[:12]


def workload_image() -> str:
    return f"{REPOSITORY}:{image_tag()}"


# Labs (by state directory and holder pid) whose registry this process has seen holding the image:
# every workload start ensures the image, and asking the registry each time costs a skopeo run.
_loaded: set[tuple[Path, int | None, str]] = set()


def ready_lab(
    lab: Lab,
    nodes: int = 2,
    report: Report = lambda _m: None,
    router: str | None = None,
    runtime: str = "podman",
    firewall: str = "none",
) -> dict[str, Any]:
    """``lab.up``, then the workload image into its registry: a lab ready to start workloads; its status."""
    st = lab.up(nodes=nodes, report=report, router=router, runtime=runtime, firewall=firewall)
    ensure_workload_image(lab, report)
    return st


def ensure_workload_image(lab: Lab, report: Report = lambda _m: None) -> str:
    """The workload image's reference, built (or taken from the cache) and loaded into the lab's registry."""
    return ensure_image(lab, workload_image(), _load, report)


Load = Callable[["Lab", str, "Report"], None]


def ensure_image(lab: Lab, ref: str, load: Load, report: Report) -> str:
    """``ref`` in the lab's registry, ``load`` run (build and copy it there) if it is not yet."""
    seen = (lab.dir, lab.holder_pid(), ref)
    if seen in _loaded:
        return ref
    have = lab.run("node-a", ["skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{ref}"], check=False)
    if have.returncode:
        load(lab, ref, report)
    _loaded.add(seen)
    return ref


def rootfs_tar(lab: Lab, prefix: str, packages: str, report: Report) -> str:
    """A Debian root file system with ``packages`` (mmdebstrap), built once into the lab cache; its
    path inside the lab."""
    rootfs = f"{layout.IN_LAB_CACHE}/{prefix}-{hashlib.sha256(packages.encode()).hexdigest()[:8]}.tar"
    if (lab.cache / Path(rootfs).name).exists():
        return rootfs
    report(f"building the {prefix}: {packages} with mmdebstrap (about a minute)")
    part = _part_name(rootfs)
    try:
        lab.run(
            "lab",
            [
                "mmdebstrap",
                "--quiet",
                "--variant=essential",
                f"--include={packages}",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                SUITE,
                part,
                mirror.debian_mirror(),
            ],
            timeout=1800,
        )
        _publish(lab.cache / Path(part).name, lab.cache / Path(rootfs).name)
    finally:
        _discard(lab.cache / Path(part).name)
    return rootfs


def push_archive(lab: Lab, archive: str, ref: str, what: str, report: Report) -> None:
    """An OCI archive of the lab cache into the lab's registry as ``ref``."""
    report(f"loading the {what} image into the lab registry ({ref})")
    lab.run(
        "node-a",
        ["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci-archive:{archive}", f"docker://{ref}"],
        timeout=600,
    )


def _load(lab: Lab, ref: str, report: Report) -> None:
    """Build the image (each step cached in ``lab.cache``) and copy it into the lab's registry."""
    tag = image_tag()
    archive = f"{layout.IN_LAB_CACHE}/stream-server-{tag}.oci.tar"
    if not (lab.cache / Path(archive).name).exists():
        rootfs = rootfs_tar(lab, "workload-rootfs", ROOTFS_PACKAGES, report)
        report("building the workload image with buildah")
        src = f"{layout.IN_LAB_SRC}/podmigrate/workload"
        part = _part_name(archive)
        script = f"""set -e
c=$(buildah from scratch)
trap 'buildah rm $c >/dev/null 2>&1 || true; rm -f {part}' EXIT
buildah add $c {rootfs} / >/dev/null
buildah copy $c {src}/heapsrv.py {src}/sidecar.py {src}/mesh.py /app/ >/dev/null
buildah config --cmd '["python3","-u","/app/heapsrv.py"]' --env HEAP_MB=64 --port 8000 \
  --label org.opencontainers.image.title=stream-server $c
buildah commit -q $c localhost/stream-server:{tag} >/dev/null
buildah push -q localhost/stream-server:{tag} oci-archive:{part}
buildah rmi localhost/stream-server:{tag} >/dev/null
mv -f {part} {archive}
"""
        lab.run("node-a", ["sh", "-c", script], timeout=1800)
    push_archive(lab, archive, ref, "workload", report)


def _part_name(path: str) -> str:
    """A temporary name beside ``path`` that no other builder uses (pid and random)."""
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}.part"


def _publish(part: Path, dest: Path) -> None:
    """Rename ``part`` to ``dest`` at once; if another builder got there first, theirs is kept.

    mmdebstrap writes a directory here (the name's suffix is no archive format it knows), and a
    directory cannot replace a non-empty one, so ``dest`` appearing meanwhile means ours is spare."""
    try:
        os.rename(part, dest)
    except OSError:
        if not dest.exists():
            raise


def _discard(part: Path) -> None:
    if part.is_dir() and not part.is_symlink():
        shutil.rmtree(part, ignore_errors=True)
    else:
        part.unlink(missing_ok=True)
