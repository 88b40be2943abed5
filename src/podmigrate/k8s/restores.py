"""The node agent's side of the RuntimeClass restore path: fetch, verify and unpack a checkpoint image.

The podmigrate RuntimeClass (``runtime.runc_restore`` on the node) restores from a directory, never
from a registry: the agent pulls each checkpoint image first by ``reference@digest`` (the manifest
digest the operator recorded at package: a tag moved since is not followed), checks that the registry
answered that manifest and that the layer matches its digest (``transport.oci``), unpacks
``checkpoint/`` and ``rootfs-diff.tar``, and only then writes ``podmigrate-verified.json``, without
which the wrapper refuses to restore. A tampered or replaced image is refused here, before anything
runs; so is one from a registry outside the agent's allow-list. Everything is 0700/0600: it is
process memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podmigrate.agent.http import App
from podmigrate.errors import TransportError, UsageError
from podmigrate.k8s.policy import Policy, Refused, by_digest
from podmigrate.transport import registry
from podmigrate.transport.oci import LAYER_TYPE, MEDIA_SUFFIX, SEALED_SUFFIX
from podmigrate.transport.stream import Seal

_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
VERIFIED = "podmigrate-verified.json"  # runtime.runc_restore looks for it
WANTED = ("checkpoint/", "rootfs-diff.tar")  # what runc restore needs of the archive


@dataclass
class Restores:
    local: Path  # the restore directory as the agent sees it
    node: Path  # the same directory as the node's runtime sees it (the wrapper's restore_dir)
    handler: str = "podmigrate"

    def _dir(self, cid: str, container: str = "") -> tuple[Path, Path]:
        for part in (cid, container) if container else (cid,):
            if not _SAFE.fullmatch(part) or part in (".", ".."):
                raise UsageError(f"not a valid checkpoint id or container name: {part!r}")
        rel = Path(cid) / container if container else Path(cid)
        return self.local / rel, self.node / rel

    def fetch(
        self, cid: str, container: str, reference: str, digest: str, sealed: Seal | None = None
    ) -> dict[str, Any]:
        local, node = self._dir(cid, container)
        t0 = time.time()
        if (local / VERIFIED).exists():  # a repeated request (an operator that restarted)
            got = json.loads((local / VERIFIED).read_text())
            if got.get("manifest_digest") == digest:
                return {"path": str(node), "bytes": got.get("bytes", 0), "seconds": 0.0, "repeated": True}
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(mode=0o700, parents=True)
        with tempfile.TemporaryDirectory(dir=local.parent) as tmp:
            archive = Path(tmp) / "layer.tar"
            try:
                pulled = pull_by_digest(reference, digest, archive, sealed)
            except TransportError:
                shutil.rmtree(local, ignore_errors=True)
                raise
            _unpack(archive, local)
        os.umask(0o077)
        info = {**{k: pulled[k] for k in ("reference", "manifest_digest", "layer_digest", "bytes")}, "at": time.time()}
        (local / VERIFIED).write_text(json.dumps(info))
        return {"path": str(node), "bytes": pulled["bytes"], "seconds": time.time() - t0}

    def delete(self, cid: str) -> bool:
        local, _ = self._dir(cid)
        existed = local.exists()
        shutil.rmtree(local, ignore_errors=True)
        return existed

    def routes(self, app: App, policy: Policy | None = None) -> None:
        """``policy``: the registries (and namespaces) this node restores from; a checkpoint from
        elsewhere would run whatever its author put in it."""

        @app.route("POST", "/v1/restores")
        def fetch(p: dict[str, str], b: dict[str, Any]) -> Any:
            if policy is not None:
                if not b.get("namespace"):
                    raise UsageError(f"agent {app.name}: a restore names the namespace of its migration")
                try:
                    policy.check_namespace(str(b["namespace"]))
                    for i in b["images"].values():
                        policy.check_registry(str(i["reference"]), "restore from")
                except Refused as e:
                    raise UsageError(f"agent {app.name}: {e}") from None
            cid = str(b["checkpoint_id"])
            out = {
                c: self.fetch(
                    cid, c, i["reference"], i["digest"], Seal(b["seal"], f"{cid}.{c}") if b.get("seal") else None
                )
                for c, i in b["images"].items()
            }
            return {"restores": out}

        @app.route("POST", "/v1/restores/delete")
        def delete(p: dict[str, str], b: dict[str, Any]) -> Any:
            return {"deleted": self.delete(b["checkpoint_id"])}


def pull_by_digest(reference: str, digest: str, dest: Path, sealed: Seal | None = None) -> dict[str, Any]:
    """The checkpoint layer of ``reference``'s manifest ``digest`` into ``dest``, checked on the way
    and, when ``sealed``, opened with the migration's key (an unsealed layer is then refused)."""
    try:
        pinned = by_digest(reference, digest)
    except Refused as e:
        raise TransportError(str(e)) from None
    host, _, rest = pinned.partition("/")
    repo = rest.partition("@")[0]
    reg = registry.Registry(host, repo=repo)
    refused = f"{reference} is not the checkpoint image that was pushed"
    hint = "someone replaced or deleted it in the registry; the migration rolls back, the source keeps serving"
    try:
        manifest, got = reg.get_manifest(repo, digest)
    except TransportError as e:
        raise TransportError(f"{refused}: no manifest {digest} ({e.message}); refusing to restore it", hint=hint) from e
    if got != digest:  # the registry addresses manifests by content; one that says otherwise lies
        raise TransportError(f"{refused}: manifest {got}, expected {digest}; refusing to restore it", hint=hint)
    ann = manifest.get("annotations") or {}
    layers = manifest.get("layers") or []
    if registry.CRIO_ANNOTATION not in ann or len(layers) != 1:
        raise TransportError(f"{pinned} is not a podmigrate checkpoint image; refusing to restore it")
    mt = str(layers[0].get("mediaType", LAYER_TYPE))
    if mt.endswith(SEALED_SUFFIX) and sealed is None:
        raise TransportError(f"{pinned} is sealed for a migration, and this restore has no key for it")
    if sealed is not None and not mt.endswith(SEALED_SUFFIX):
        raise TransportError(f"{pinned} is not sealed, but its migration seals checkpoints; refusing to restore it")
    mt = mt.removesuffix(SEALED_SUFFIX)
    compression = next((c for c, suf in MEDIA_SUFFIX.items() if suf and mt.endswith(suf)), "none")
    seal_ctx = (sealed.key, sealed.context("layer")) if sealed else None
    size = reg.fetch_blob(repo, layers[0]["digest"], dest, layers[0].get("size"), compression, seal_ctx)
    return {"reference": pinned, "manifest_digest": digest, "layer_digest": layers[0]["digest"], "bytes": size}


def _unpack(archive: Path, dest: Path) -> None:
    """The parts of the runtime's archive that runc restore needs, refusing paths that leave ``dest``."""
    with tarfile.open(archive, "r:*") as t:
        members = []
        for m in t.getmembers():
            name = m.name.lstrip("./") if m.name.startswith("./") else m.name
            if name.startswith("/") or ".." in Path(name).parts:
                raise TransportError(f"checkpoint archive member {m.name!r} leaves the archive; refusing it")
            if m.issym() or m.islnk() or m.isdev():
                raise TransportError(f"checkpoint archive member {m.name!r} is a link or device; refusing it")
            if name.startswith(WANTED[0]) or name == WANTED[1] or name == WANTED[0].rstrip("/"):
                members.append(m)
        if not any(m.name.endswith("descriptors.json") for m in members):
            raise TransportError(f"{archive} has no checkpoint/descriptors.json: not a runc checkpoint archive")
        t.extractall(dest, members=members, filter="data")
    for root, _dirs, files in os.walk(dest):
        os.chmod(root, 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)
