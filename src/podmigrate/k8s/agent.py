"""The Kubernetes node agent (one per node, a DaemonSet): kubelet checkpoint -> OCI image -> registry.

It is the lab's node agent (same route table, bearer-token auth and JSON errors, ``agent.http.App``)
with a Kubernetes backend: the kubelet's Checkpoint API instead of Podman, and the same streamed
checkpoint-image push (``transport.registry``: the archive is the image's one layer, CRI-O's
annotations on the manifest). Restoring needs no agent: the kubelet and CRI-O restore a pod whose
image is the checkpoint image. Routes (all need ``Authorization: Bearer <token>``)::

    GET  /healthz                       liveness (no token)
    GET  /v1/info                       node, checkpoint directory, free disk, archives present
    POST /v1/checkpoints                {namespace, pod, containers, checkpoint_id, timeout} -> archives
    POST /v1/images                     {archives, references, compression} -> pushed images; archives deleted
    POST /v1/images/delete              {references} -> registry tags deleted
    POST /v1/archives/delete            {checkpoint_id, containers} -> that migration's archives deleted
    POST /v1/gc                         {older_than_s} -> stale archives deleted
    POST /v1/restores                   {checkpoint_id, images: {container: {reference, digest}}} ->
                                        each image pulled, its manifest and layer digests checked, unpacked
                                        for the podmigrate RuntimeClass (``k8s.restores``); node paths
    POST /v1/restores/delete            {checkpoint_id} -> that migration's unpacked checkpoints deleted

Run: ``python -m podmigrate.k8s.agent --node $NODE_NAME --kubelet https://$HOST_IP:10250 --listen
0.0.0.0:7070`` with the token in ``$PODMIGRATE_AGENT_TOKEN`` (or ``--token-file``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from podmigrate.agent.http import App, make_handler
from podmigrate.errors import UsageError
from podmigrate.k8s.kubelet import CHECKPOINT_DIR, KubeletClient
from podmigrate.k8s.restores import Restores
from podmigrate.transport import registry

_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def build_app(
    name: str,
    token: str,
    kubelet: KubeletClient,
    checkpoint_dir: Path = CHECKPOINT_DIR,
    restores: Restores | None = None,
) -> App:
    app = App(name, "k8s-node", token)
    lock = threading.Lock()  # one kubelet checkpoint at a time: CRIU freezes are best not overlapped

    def inside(path: str) -> Path:
        p = Path(path).resolve()
        if p.parent != checkpoint_dir.resolve() or p.suffix != ".tar":
            raise UsageError(f"{path} is not a checkpoint archive in {checkpoint_dir}; refusing to touch it")
        return p

    @app.route("GET", "/v1/info")
    def info(p: dict[str, str], b: dict[str, Any]) -> Any:
        archives = sorted(checkpoint_dir.glob("*.tar")) if checkpoint_dir.exists() else []
        return {
            "name": app.name,
            "checkpoint_dir": str(checkpoint_dir),
            "disk_free_bytes": shutil.disk_usage(checkpoint_dir).free if checkpoint_dir.exists() else None,
            "archives": [{"path": str(a), "bytes": a.stat().st_size, "mtime": a.stat().st_mtime} for a in archives],
            "restore_handler": restores.handler if restores else None,
        }

    def ours(cid: str, container: str) -> Path:
        if not _SAFE.match(cid) or not _SAFE.match(container):
            raise UsageError(f"not a valid checkpoint id or container name: {cid!r} {container!r}")
        return checkpoint_dir / f"podmigrate-{cid}-{container}.tar"

    @app.route("POST", "/v1/checkpoints")
    def checkpoint(p: dict[str, str], b: dict[str, Any]) -> Any:
        ns, pod, containers, cid = b["namespace"], b["pod"], list(b["containers"]), b["checkpoint_id"]
        out: dict[str, Any] = {}
        t0 = time.time()
        with lock:
            for c in containers:
                started = time.time()
                path = kubelet.checkpoint(ns, pod, c, int(b.get("timeout", 120)))
                # the kubelet names a path on the node; the agent sees that directory at checkpoint_dir
                local = inside(str(checkpoint_dir / path.name))
                if not local.exists():
                    raise UsageError(
                        f"the kubelet wrote {path}, but the agent does not see it at {local}",
                        hint=f"mount the node's {CHECKPOINT_DIR} into the agent at {checkpoint_dir}",
                    )
                # process memory, secrets included: owner-only, whatever the kubelet's umask was
                os.chmod(local, 0o600)
                # named after the migration, so a repeated request (an operator that restarted) replaces
                # the archive instead of leaking one, and an undo finds it without knowing the path
                dest = ours(cid, c)
                local.rename(dest)
                out[c] = {"path": str(dest), "bytes": dest.stat().st_size, "seconds": time.time() - started}
        return {"archives": out, "seconds": time.time() - t0}

    @app.route("POST", "/v1/images")
    def images(p: dict[str, str], b: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        t0 = time.time()
        for c, path in b["archives"].items():
            archive = inside(path)
            ref = b["references"][c]
            if not archive.exists():  # a repeated request: the first one pushed it and deleted the archive
                host, repo, tag = registry.split_reference(ref)
                manifest, digest = registry.Registry(host, repo=repo).get_manifest(repo, tag)
                layer = manifest["layers"][0]
                out[c] = {"reference": ref, "manifest_digest": digest, "layer_digest": layer["digest"],
                          "bytes": layer["size"], "repeated": True}  # fmt: skip
                continue
            ann = registry.checkpoint_annotations(c, {"io.podmigrate.source": f"{b.get('namespace')}/{b.get('pod')}"})
            out[c] = registry.push_checkpoint(archive, ref, ann, b.get("compression", "none"))
            # the kubelet never deletes its archives; once the image is in the registry the copy is waste
            archive.unlink(missing_ok=True)
        return {"images": out, "seconds": time.time() - t0}

    @app.route("POST", "/v1/images/delete")
    def delete_images(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"deleted": {ref: registry.delete_checkpoint(ref) for ref in b["references"]}}

    @app.route("POST", "/v1/archives/delete")
    def delete_archives(p: dict[str, str], b: dict[str, Any]) -> Any:
        """Delete the archives of a migration (``checkpoint_id``, optionally ``containers``)."""
        done = {}
        with lock:  # wait for a checkpoint still running for this migration
            for c in b.get("containers") or []:
                a = ours(b["checkpoint_id"], c)
                done[str(a)] = a.exists()
                a.unlink(missing_ok=True)
        return {"deleted": done}

    @app.route("POST", "/v1/gc")
    def gc(p: dict[str, str], b: dict[str, Any]) -> Any:
        cutoff = time.time() - float(b.get("older_than_s", 3600))
        gone = []
        # only what podmigrate made (and kubelet archives it renamed): other tools' checkpoints are theirs
        for a in checkpoint_dir.glob("podmigrate-*.tar") if checkpoint_dir.exists() else []:
            if a.stat().st_mtime < cutoff:
                a.unlink(missing_ok=True)
                gone.append(str(a))
        return {"deleted": gone}

    if restores is not None:
        restores.routes(app)
    return app


def serve(app: App, listen: str) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")
    handler: Any = make_handler(app)
    original = handler.do_GET

    def do_get(self: Any) -> None:
        if self.path == "/healthz":  # kubelet liveness probes carry no token
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            return
        original(self)

    handler.do_GET = do_get
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    return ThreadingHTTPServer((host or "0.0.0.0", int(port)), handler)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="podmigrate-k8s-agent")
    ap.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (downward API)")
    ap.add_argument("--kubelet", default=f"https://{os.environ.get('HOST_IP', '127.0.0.1')}:10250")
    ap.add_argument("--kubelet-ca", default=None, help="CA of the kubelet's serving certificate")
    ap.add_argument("--kubelet-insecure-tls", action="store_true", help="do not verify the kubelet's certificate")
    ap.add_argument("--kubelet-token-file", default=str(SA_TOKEN))
    ap.add_argument("--checkpoint-dir", default=str(CHECKPOINT_DIR))
    ap.add_argument("--restore-dir", help="the podmigrate RuntimeClass's checkpoint directory (enables it)")
    ap.add_argument("--listen", default="0.0.0.0:7070")
    ap.add_argument("--token-file", help="agent API token (default: $PODMIGRATE_AGENT_TOKEN)")
    args = ap.parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("PODMIGRATE_AGENT_TOKEN")
    if not token or not args.node:
        sys.exit("podmigrate-k8s-agent: needs --node (or $NODE_NAME) and a token ($PODMIGRATE_AGENT_TOKEN)")
    kubelet = KubeletClient(args.kubelet, Path(args.kubelet_token_file), args.kubelet_ca, args.kubelet_insecure_tls)
    restores = Restores(Path(args.restore_dir), Path(args.restore_dir)) if args.restore_dir else None
    server = serve(build_app(args.node, token, kubelet, Path(args.checkpoint_dir), restores), args.listen)
    print(f"podmigrate node agent {args.node} on {args.listen}, kubelet {args.kubelet}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
