"""The ``registry`` transport: a checkpoint as a one-layer OCI image (runs in node agents; standard library only).

The image is built by hand instead of with ``podman checkpoint --create-image`` (which passes over the
data about four times): podman's uncompressed export archive is already a valid OCI layer (a tar of
``config.dump``, ``spec.dump``, ``checkpoint/``, ``rootfs-diff.tar``...), which is exactly the layout
CRI-O's checkpoint images carry. So the push streams the archive once, hashing it on the way, and the
pull streams it once into the target's checkpoint directory, checking the digest before anything
restores from it. Manifest annotations mark it as a checkpoint for CRI-O and Podman. The registry
client is ``transport.oci``; siblings ``transport.stream`` and ``transport.archive`` skip the registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate.errors import TransportError
from podmigrate.transport.base import Sent
from podmigrate.transport.oci import (
    COMPRESSIONS,
    CONFIG_TYPE,
    LAYER_TYPE,
    MANIFEST_TYPE,
    MEDIA_SUFFIX,
    SEALED_SUFFIX,
    Registry,
    split_reference,
)
from podmigrate.transport.stream import Seal

if TYPE_CHECKING:
    from podmigrate.transport.base import Transport

__all__ = [
    "CRIO_ANNOTATION",
    "PODMAN_ANNOTATION",
    "Pushed",
    "Registry",
    "RegistryTransport",
    "checkpoint_annotations",
    "delete_checkpoint",
    "pull_checkpoint",
    "push_checkpoint",
    "split_reference",
]

CRIO_ANNOTATION = "io.kubernetes.cri-o.annotations.checkpoint.name"
PODMAN_ANNOTATION = "io.podman.annotations.checkpoint.name"


class Pushed(Sent):
    reference: str
    manifest_digest: str
    layer_digest: str
    uncompressed_bytes: int
    compression: str
    sealed: bool  # the layer went up sealed for its migration


class RegistryTransport:
    """Push on the source, pull on the target (``fetch``), delete the image to undo (``discard``).

    ``annotations`` go on the manifest; ``compression`` (none, gzip, zstd) applies to the layer;
    ``sealed``: the layer is sealed for the migration after compression (``transport.seal``), so the
    image at rest in the registry is ciphertext, and a pull opens it or refuses it."""

    def __init__(
        self, annotations: dict[str, str] | None = None, compression: str = "none", sealed: Seal | None = None
    ):
        self.annotations, self.compression, self.sealed = annotations or {}, compression, sealed

    def send(self, archive: Path, to: str) -> Pushed:
        return push_checkpoint(archive, to, self.annotations, self.compression, self.sealed)

    def fetch(self, reference: str, dest: Path) -> dict[str, Any]:
        return pull_checkpoint(reference, dest, self.sealed)

    def discard(self, reference: str) -> bool:
        return delete_checkpoint(reference)


if TYPE_CHECKING:

    def _conforms(t: RegistryTransport) -> Transport:
        return t


_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")  # a path component (OCI distribution spec)


def repository_component(name: str) -> str:
    """``name`` as one component of a repository path. Container names may end in '-', hold '..' or
    capitals, which no registry accepts; those become a cleaned name plus a hash of the original, so
    two names never share a repository and the push cannot fail after the freeze for a name."""
    if _COMPONENT.fullmatch(name) and len(name) <= 128:
        return name
    clean = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:100] or "workload"
    return f"{clean}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def checkpoint_annotations(container: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        CRIO_ANNOTATION: container,
        PODMAN_ANNOTATION: container,
        "org.criu.checkpoint.container.name": container,
        "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(extra or {}),
    }


def push_checkpoint(
    archive: Path, reference: str, annotations: dict[str, str], compression: str = "none", sealed: Seal | None = None
) -> Pushed:
    """Push ``archive`` as a one-layer OCI checkpoint image; returns digests and sizes."""
    if compression not in COMPRESSIONS:
        raise TransportError(f"unknown compression {compression!r}; use one of {', '.join(COMPRESSIONS)}")
    host, repo, tag = split_reference(reference)
    reg = Registry(host, repo=repo)
    t0 = time.time()
    seal_ctx = (sealed.key, sealed.context("layer")) if sealed else None
    layer_digest, layer_size, diff_id = reg.push_blob_file(repo, archive, compression, seal_ctx)
    config = {
        "architecture": os.uname().machine.replace("x86_64", "amd64").replace("aarch64", "arm64"),
        "os": "linux",
        # sealed: the plaintext's digest would let anyone holding a guess of the memory confirm it
        "rootfs": {"type": "layers", "diff_ids": [layer_digest if sealed else diff_id]},
        "config": {"Labels": annotations},
    }
    cfg_digest, cfg_size = reg.push_blob_bytes(repo, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": cfg_digest, "size": cfg_size},
        "layers": [
            {
                "mediaType": LAYER_TYPE + MEDIA_SUFFIX[compression] + (SEALED_SUFFIX if sealed else ""),
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
        "annotations": annotations,
    }
    digest = reg.put_manifest(repo, tag, manifest)
    return {
        "reference": reference,
        "manifest_digest": digest,
        "layer_digest": layer_digest,
        "bytes": layer_size,
        "uncompressed_bytes": archive.stat().st_size,
        "compression": compression,
        "sealed": sealed is not None,
        "started": t0,
        "ended": time.time(),
    }


def pull_checkpoint(reference: str, dest: Path, sealed: Seal | None = None) -> dict[str, Any]:
    """Fetch the checkpoint layer of ``reference`` into ``dest``, verified against its digest and,
    when ``sealed``, opened with the migration's key (an unsealed layer is then refused)."""
    host, repo, tag = split_reference(reference)
    reg = Registry(host, repo=repo)
    t0 = time.time()
    manifest, digest = reg.get_manifest(repo, tag)
    ann = manifest.get("annotations") or {}
    if CRIO_ANNOTATION not in ann or len(manifest.get("layers") or []) != 1:
        raise TransportError(
            f"{reference} is not a podmigrate checkpoint image (no {CRIO_ANNOTATION} "
            "annotation or not exactly one layer)"
        )
    layer = manifest["layers"][0]
    mt = str(layer.get("mediaType", LAYER_TYPE))
    is_sealed = mt.endswith(SEALED_SUFFIX)
    if is_sealed and sealed is None:
        raise TransportError(f"{reference} is sealed for a migration, and this pull has no key for it")
    if sealed is not None and not is_sealed:
        raise TransportError(f"{reference} is not sealed, but its migration seals checkpoints; refused")
    mt = mt.removesuffix(SEALED_SUFFIX)
    compression = next((c for c, suf in MEDIA_SUFFIX.items() if suf and mt.endswith(suf)), "none")
    seal_ctx = (sealed.key, sealed.context("layer")) if sealed else None
    size = reg.fetch_blob(repo, layer["digest"], dest, layer.get("size"), compression, seal_ctx)
    return {
        "reference": reference,
        "manifest_digest": digest,
        "layer_digest": layer["digest"],
        "bytes": size,
        "compression": compression,
        "sealed": is_sealed,
        "container": ann[CRIO_ANNOTATION],
        "started": t0,
        "ended": time.time(),
    }


def delete_checkpoint(reference: str) -> bool:
    """Delete the tag's manifest and its blobs; False when it was already gone."""
    host, repo, tag = split_reference(reference)
    reg = Registry(host, repo=repo)
    try:
        manifest, digest = reg.get_manifest(repo, tag)
    except TransportError as e:
        if "answered 404" in e.message:
            return False
        raise
    reg.delete(repo, digest)
    for blob in [manifest["config"], *manifest.get("layers", [])]:
        reg.delete(repo, blob["digest"], kind="blobs")
    return True
