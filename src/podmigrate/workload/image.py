"""Builds the workload image offline: a Debian trixie rootfs with python3 + numpy (mmdebstrap),
stream-server, the sidecar and the background load's mesh service on top, FROM scratch with buildah.

Both steps are cached in ``$PODMIGRATE_HOME/cache``: the rootfs tarball by its package list, the OCI
archive by the hash of that plus the workload's sources. A new lab only copies the archive into its
registry (skopeo), a few seconds.

The lab (``podmigrate.lab``) knows nothing of this image: ``manage.start`` ensures it before a start,
and ``ready_lab`` is ``lab up`` followed by loading it, for those who want a lab ready at once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate import layout
from podmigrate.lab.image import MIRROR, SUITE

if TYPE_CHECKING:
    from podmigrate.lab.cluster import Lab, Report

HERE = Path(__file__).resolve().parent
SOURCES = ("heapsrv.py", "sidecar.py", "mesh.py")
ROOTFS_PACKAGES = "python3,python3-numpy"
REPOSITORY = f"{layout.REGISTRY}/podmigrate/stream-server"


def image_tag() -> str:
    h = hashlib.sha256(f"{SUITE} {MIRROR} {ROOTFS_PACKAGES}".encode())
    for s in SOURCES:
        h.update((HERE / s).read_bytes())
    return h.hexdigest()[:12]


def workload_image() -> str:
    return f"{REPOSITORY}:{image_tag()}"


# Labs (by state directory and holder pid) whose registry this process has seen holding the image:
# every workload start ensures the image, and asking the registry each time costs a skopeo run.
_loaded: set[tuple[Path, int | None, str]] = set()


def ready_lab(
    lab: Lab, nodes: int = 2, report: Report = lambda _m: None, router: str | None = None, runtime: str = "podman"
) -> dict[str, Any]:
    """``lab.up``, then the workload image into its registry: a lab ready to start workloads; its status."""
    st = lab.up(nodes=nodes, report=report, router=router, runtime=runtime)
    ensure_workload_image(lab, report)
    return st


def ensure_workload_image(lab: Lab, report: Report = lambda _m: None) -> str:
    """The workload image's reference, built (or taken from the cache) and loaded into the lab's registry."""
    ref = workload_image()
    seen = (lab.dir, lab.holder_pid(), ref)
    if seen in _loaded:
        return ref
    have = lab.run("node-a", ["skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{ref}"], check=False)
    if have.returncode:
        _load(lab, ref, report)
    _loaded.add(seen)
    return ref


def _load(lab: Lab, ref: str, report: Report) -> None:
    """Build the image (each step cached in ``lab.cache``) and copy it into the lab's registry."""
    tag = image_tag()
    cache = layout.IN_LAB_CACHE
    rootfs = f"{cache}/workload-rootfs-{hashlib.sha256(ROOTFS_PACKAGES.encode()).hexdigest()[:8]}.tar"
    archive = f"{cache}/stream-server-{tag}.oci.tar"
    if not (lab.cache / Path(archive).name).exists():
        if not (lab.cache / Path(rootfs).name).exists():
            report("building the workload rootfs: python3 + numpy with mmdebstrap (about a minute)")
            lab.run(
                "lab",
                [
                    "mmdebstrap",
                    "--quiet",
                    "--variant=essential",
                    f"--include={ROOTFS_PACKAGES}",
                    "--dpkgopt=path-exclude=/usr/share/doc/*",
                    "--dpkgopt=path-exclude=/usr/share/man/*",
                    "--dpkgopt=path-exclude=/usr/share/locale/*",
                    SUITE,
                    rootfs + ".part",
                    MIRROR,
                ],
                timeout=1800,
            )
            lab.run("lab", ["mv", rootfs + ".part", rootfs])
        report("building the workload image with buildah")
        src = f"{layout.IN_LAB_SRC}/podmigrate/workload"
        script = f"""set -e
c=$(buildah from scratch)
trap 'buildah rm $c >/dev/null 2>&1 || true' EXIT
buildah add $c {rootfs} / >/dev/null
buildah copy $c {src}/heapsrv.py {src}/sidecar.py {src}/mesh.py /app/ >/dev/null
buildah config --cmd '["python3","-u","/app/heapsrv.py"]' --env HEAP_MB=64 --port 8000 \
  --label org.opencontainers.image.title=stream-server $c
buildah commit -q $c localhost/stream-server:{tag} >/dev/null
buildah push -q localhost/stream-server:{tag} oci-archive:{archive}.part
buildah rmi localhost/stream-server:{tag} >/dev/null
mv {archive}.part {archive}
"""
        lab.run("node-a", ["sh", "-c", script], timeout=1800)
    report(f"loading the workload image into the lab registry ({ref})")
    lab.run(
        "node-a",
        ["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci-archive:{archive}", f"docker://{ref}"],
        timeout=600,
    )
