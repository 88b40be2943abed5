"""podmigrate's own image, built as a user builds it: ``deploy/Containerfile`` with buildah.

The Containerfile's default base (``python:3.11-slim``) is on a container registry this machine cannot
reach, so the lab gives it another through its ``BASE`` argument: a Debian root file system with
python3, its venv module and zstd (mmdebstrap from the mirror the host's apt uses, cached like the
workload's). The build runs inside the lab (its mount namespace) on the host's network, since its
``RUN`` steps install from Debian and PyPI; the host's CA bundle is mounted over the build
container's for those steps only and is not in the image. The result is an OCI archive in the lab
cache, named by the hash of everything that goes into it, copied into the lab's registry.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

import podmigrate
from podmigrate import layout
from podmigrate.errors import LabError
from podmigrate.lab import mirror
from podmigrate.lab.cluster import Lab, Report
from podmigrate.lab.containerd import NODE_REGISTRY
from podmigrate.lab.image import SUITE
from podmigrate.workload.image import ensure_image, push_archive, rootfs_tar

BASE_PACKAGES = "apt,python3,python3-venv,zstd,ca-certificates"
REPOSITORY = f"{layout.REGISTRY}/podmigrate/podmigrate"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def source_root() -> Path:
    """The checkout the image is built from: the Containerfile and the sources beside it."""
    root = Path(podmigrate.__file__).resolve().parents[2]
    if not (root / "deploy" / "Containerfile").exists() or not (root / "pyproject.toml").exists():
        raise LabError(
            "podmigrate's image is built from a source checkout, and this installation has none",
            hint="run from a clone of the repository (pip install -e .)",
        )
    return root


def _context_files(root: Path) -> list[Path]:
    files = [root / "pyproject.toml", root / "README.md", root / "deploy" / "Containerfile"]
    for path in sorted((root / "src").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files.append(path)
    return files


def image_tag(root: Path | None = None) -> str:
    root = root or source_root()
    h = hashlib.sha256(f"{SUITE} {mirror.debian_mirror()} {BASE_PACKAGES}".encode())
    for path in _context_files(root):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def project_image() -> str:
    """The image's reference in the lab's registry, as the lab's agents and builders name it."""
    return f"{REPOSITORY}:{image_tag()}"


def node_reference(ref: str) -> str:
    """``ref`` as the nodes' containerd pulls it (``localhost:5000``, relayed to the registry)."""
    return ref.replace(layout.REGISTRY, NODE_REGISTRY)


def ensure_project_image(lab: Lab, report: Report = lambda _m: None) -> str:
    """The image built (or taken from the cache) and in the lab's registry; its reference there."""
    return ensure_image(lab, project_image(), _load, report)


def _load(lab: Lab, ref: str, report: Report) -> None:
    tag = ref.rsplit(":", 1)[1]
    archive = f"{layout.IN_LAB_CACHE}/podmigrate-image-{tag}.oci.tar"
    if not (lab.cache / Path(archive).name).exists():
        rootfs = rootfs_tar(lab, "python-rootfs", BASE_PACKAGES, report)
        _build(lab, rootfs, tag, archive, report)
    push_archive(lab, archive, ref, "podmigrate", report)


def _build(lab: Lab, rootfs: str, tag: str, archive: str, report: Report) -> None:
    root = source_root()
    work = lab.dir / f"image-build-{os.getpid()}-{secrets.token_hex(4)}"
    ctx = work / "context"
    try:
        for path in _context_files(root):
            dest = ctx / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        shutil.copy2(HOST_CA, work / "ca.crt")
        inside = f"{layout.IN_LAB_STATE}/{work.name}"
        part = f"{archive}.{os.getpid()}-{secrets.token_hex(4)}.part"
        base = f"localhost/podmigrate-base:{tag}"
        # storage of this build alone: buildah's mount bookkeeping is per mount namespace, and every
        # lab has its own
        b = f"buildah --root {inside}/storage --runroot /run/podmigrate-build-{work.name} --storage-driver overlay"
        script = f"""set -e
umask 022
export BUILDAH_ISOLATION=chroot
cleanup() {{ {b} rm --all >/dev/null 2>&1 || true; {b} rmi --all --force >/dev/null 2>&1 || true; rm -f {part}; }}
trap cleanup EXIT
c=$({b} from scratch)
{b} add $c {rootfs} / >/dev/null
{b} commit -q $c {base} >/dev/null
{b} rm $c >/dev/null
# buildah raises RUN's open-files and process limits to 1048576 unless told: that needs CAP_SYS_RESOURCE
{b} build --quiet --layers=false --network host --pull-never \
  --ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=$(ulimit -Hu):$(ulimit -Hu) \
  --volume {inside}/ca.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --build-arg BASE={base} -f {inside}/context/deploy/Containerfile -t localhost/podmigrate:{tag} {inside}/context
{b} push -q localhost/podmigrate:{tag} oci-archive:{part}
mv -f {part} {archive}
"""
        report("building podmigrate's image from deploy/Containerfile with buildah (pip install: a few minutes)")
        p = lab.run("lab", ["bash", "-c", script], timeout=1800, check=False)
        if p.returncode:
            raise LabError(
                "building podmigrate's image failed",
                hint="its output is in details; the build needs the Debian mirror and PyPI",
                details={"stderr": p.stderr[-4000:], "stdout": p.stdout[-2000:]},
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
