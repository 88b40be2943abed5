"""The Kubernetes node agent (one per node, a DaemonSet): kubelet checkpoint -> OCI image -> registry.

It is the lab's node agent (same route table, bearer-token auth and JSON errors, ``agent.http.App``)
with a Kubernetes backend: the kubelet's Checkpoint API instead of Podman, and the same streamed
checkpoint-image push (``transport.registry``: the archive is the image's one layer, CRI-O's
annotations on the manifest). Restoring needs no agent: the kubelet and CRI-O restore a pod whose
image is the checkpoint image. Every request is checked against the agent's own policy
(``k8s.policy``: ``--allowed-registries``/``$PODMIGRATE_ALLOWED_REGISTRIES``, default the one
``$PODMIGRATE_REGISTRY``; ``--namespaces``/``$PODMIGRATE_NAMESPACES``, default all): a checkpoint of a
pod outside the served namespaces, a push, delete or restore outside the allowed registries is refused
whatever the caller. With ``--tls-cert``/``--tls-key`` it serves https, and with ``--client-ca`` only
to callers showing a certificate of that CA (mutual TLS: the certificate is the identity, and
``--client-names`` narrows it to the operator's); otherwise a request needs
``Authorization: Bearer <token>``. Routes::

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
    POST /v1/streams...                 a streamed migration (``k8s.streams``): runc's own checkpoint on
                                        the source (with --runc-checkpoint), its pages into the waiting copy
    POST /v1/serving                    {address, checks, timeout} -> once a pod here serves (``k8s.serving``)

Run: ``python -m podmigrate.k8s.agent --node $NODE_NAME --kubelet https://$HOST_IP:10250 --kubelet-ca CA
--listen 0.0.0.0:7070 --tls-cert tls.crt --tls-key tls.key --client-ca ca.crt --health-listen
0.0.0.0:7071`` (or, without TLS, a token in ``$PODMIGRATE_AGENT_TOKEN`` or ``--token-file``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import ssl
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from podmigrate.agent.http import App, make_handler
from podmigrate.agent.tls import TLSHTTPServer
from podmigrate.errors import UsageError
from podmigrate.k8s import conntrack, serving
from podmigrate.k8s.kubelet import CHECKPOINT_DIR, KubeletClient
from podmigrate.k8s.policy import Policy, Refused, parse_list
from podmigrate.k8s.restores import Restores
from podmigrate.k8s.streams import Streams
from podmigrate.transport import registry
from podmigrate.transport.stream import Seal

CHECKPOINT_ID = "io.podmigrate.checkpoint-id"  # on each image: which migration pushed it
_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_K8S_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # namespaces, pods, containers
SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def build_app(
    name: str,
    token: str,
    kubelet: KubeletClient,
    checkpoint_dir: Path = CHECKPOINT_DIR,
    restores: Restores | None = None,
    policy: Policy | None = None,
    peers: Iterable[str] | None = None,
    streams: Streams | None = None,
) -> App:
    """``policy``: registries and namespaces served (None: any, for tests that bring their own);
    ``peers``: the client certificate names let in (None: any the client CA signed)."""
    # its one peer is the operator, which drives every step
    app = App(name, "k8s-node", token, frozenset(peers) if peers is not None else None, peers_call_all=True)
    lock = threading.Lock()  # one kubelet checkpoint at a time: CRIU freezes are best not overlapped

    def allowed(namespace: Any = None, references: Iterable[Any] = ()) -> None:
        if policy is None:
            return
        try:
            if namespace is not None:
                policy.check_namespace(str(namespace))
            for ref in references:
                policy.check_registry(str(ref), "checkpoint image")
        except Refused as e:
            raise UsageError(f"agent {name}: {e}") from None

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
            "streams": streams is not None,  # a streamed copy can wait here
            "stream_checkpoint": bool(streams and streams.checkpoint),  # and a streamed dump can start here
        }

    def ours(cid: str, container: str) -> Path:
        if not _SAFE.fullmatch(cid) or not _SAFE.fullmatch(container):
            raise UsageError(f"not a valid checkpoint id or container name: {cid!r} {container!r}")
        return checkpoint_dir / f"podmigrate-{cid}-{container}.tar"

    @app.route("POST", "/v1/checkpoints")
    def checkpoint(p: dict[str, str], b: dict[str, Any]) -> Any:
        ns, pod, containers, cid = b["namespace"], b["pod"], list(b["containers"]), b["checkpoint_id"]
        allowed(ns)
        for part in (ns, pod, *containers):  # they become a kubelet URL path
            if not _K8S_NAME.fullmatch(str(part)):
                raise UsageError(f"not a valid namespace, pod or container name: {part!r}")
        t0 = time.time()

        def one(c: str) -> dict[str, Any]:
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
            return {"path": str(dest), "bytes": dest.stat().st_size, "seconds": time.time() - started}

        # a pod's containers at once: each kubelet checkpoint freezes its container for seconds
        # (containerd packs the images while it is paused), and the pod serves only when all run
        with lock, ThreadPoolExecutor(max(1, len(containers)), "checkpoint") as pool:
            out = dict(zip(containers, pool.map(one, containers), strict=True))  # the first error raises
        return {"archives": out, "seconds": time.time() - t0}

    @app.route("POST", "/v1/images")
    def images(p: dict[str, str], b: dict[str, Any]) -> Any:
        out: dict[str, Any] = {}
        t0 = time.time()
        cid = b.get("checkpoint_id")
        if policy is not None and not (b.get("namespace") and cid):
            # what ties a push to one migration of one served namespace: without them it could be anything
            raise UsageError(f"agent {name}: a push names its namespace and checkpoint_id")
        allowed(b.get("namespace"), [b["references"][c] for c in b["archives"]])
        for c, path in b["archives"].items():
            # the operator names the migration: then only its own archives, under its own tag
            archive = inside(path) if cid is None else inside(str(ours(str(cid), c)))
            ref = b["references"][c]
            if cid is not None and not str(ref).endswith(f":{cid}".lower()):
                raise UsageError(f"{ref} is not tagged with its migration's id {cid}; refusing to push it")
            if not archive.exists():  # a repeated request: the first one pushed it and deleted the archive
                host, repo, tag = registry.split_reference(ref)
                manifest, digest = registry.Registry(host, repo=repo).get_manifest(repo, tag)
                if (manifest.get("annotations") or {}).get(CHECKPOINT_ID) != str(cid):
                    raise UsageError(f"{ref} is no longer the image migration {cid} pushed; refusing to use it")
                layer = manifest["layers"][0]
                out[c] = {"reference": ref, "manifest_digest": digest, "layer_digest": layer["digest"],
                          "bytes": layer["size"], "repeated": True}  # fmt: skip
                continue
            extra = {"io.podmigrate.source": f"{b.get('namespace')}/{b.get('pod')}", CHECKPOINT_ID: str(cid)}
            ann = registry.checkpoint_annotations(c, extra)
            sealed = Seal(str(b["seal"]), f"{cid}.{c}") if b.get("seal") and cid else None
            out[c] = registry.push_checkpoint(archive, ref, ann, b.get("compression", "none"), sealed)
            # the kubelet never deletes its archives; once the image is in the registry the copy is waste
            archive.unlink(missing_ok=True)
        return {"images": out, "seconds": time.time() - t0}

    @app.route("POST", "/v1/images/delete")
    def delete_images(p: dict[str, str], b: dict[str, Any]) -> Any:
        allowed(b.get("namespace"), b["references"])
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
        restores.routes(app, policy)
    if streams is not None:
        streams.routes(app)
    serving.routes(app)  # whether a copy serves, checked here before the kubelet's Ready (every mode but cold)
    conntrack.routes(app)  # a moved pod's old address forgotten by this node's connection tracking
    return app


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The listener's TLS: this agent's certificate; with ``client_ca``, mutual TLS (a caller without
    a certificate of that CA is refused in the handshake, before any byte of HTTP)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx


def serve_health(listen: str) -> ThreadingHTTPServer:
    """Plain ``GET /healthz`` on its own port: the kubelet's probes carry no client certificate."""

    class Health(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            ok = self.path == "/healthz"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", "2" if ok else "0")
            self.end_headers()
            if ok:
                self.wfile.write(b"ok")

    host, _, port = listen.rpartition(":")
    ThreadingHTTPServer.daemon_threads = True
    return ThreadingHTTPServer((host or "0.0.0.0", int(port)), Health)


def serve(app: App, listen: str, tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    """The agent's listener: plain HTTP, or https with ``tls`` (``server_context``)."""
    host, _, port = listen.rpartition(":")

    class Handler(make_handler(app)):  # type: ignore[misc]
        def end_headers(self) -> None:
            # the handler closes after an error reply; saying so keeps a keep-alive client (the
            # operator's) from sending its next request into the closing connection
            if self.close_connection:
                self.send_header("Connection", "close")
            super().end_headers()

    handler: Any = Handler
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
    if tls is not None:
        return TLSHTTPServer((host or "0.0.0.0", int(port)), handler, tls)
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    return ThreadingHTTPServer((host or "0.0.0.0", int(port)), handler)


def main(argv: list[str] | None = None) -> None:
    env = os.environ
    ap = argparse.ArgumentParser(prog="podmigrate-k8s-agent")
    ap.add_argument("--node", default=env.get("NODE_NAME"), help="this node's name (downward API)")
    ap.add_argument("--kubelet", default=f"https://{env.get('HOST_IP', '127.0.0.1')}:10250")
    ap.add_argument("--kubelet-ca", default=None, help="CA of the kubelet's serving certificate")
    ap.add_argument("--kubelet-insecure-tls", action="store_true", help="do not verify the kubelet (development only)")
    ap.add_argument("--kubelet-token-file", default=str(SA_TOKEN))
    ap.add_argument("--checkpoint-dir", default=str(CHECKPOINT_DIR))
    ap.add_argument("--restore-dir", help="the podmigrate RuntimeClass's checkpoint directory (enables it)")
    ap.add_argument("--runc-checkpoint", action="store_true",
                    help="streamed migrations checkpoint here with runc (needs hostPID, privileges)")  # fmt: skip
    ap.add_argument("--runc-root", default="/run/containerd/runc/k8s.io", help="runc's state of the pods' containers")
    ap.add_argument("--stream-address", default=env.get("HOST_IP", ""),
                    help="this node's address for streamed pages (default $HOST_IP)")  # fmt: skip
    ap.add_argument("--listen", default="0.0.0.0:7070")
    ap.add_argument("--health-listen", help="plain-HTTP /healthz for the kubelet's probes, e.g. 0.0.0.0:7071")
    ap.add_argument("--tls-cert", help="serve https with this certificate (PEM)")
    ap.add_argument("--tls-key", help="... and its key")
    ap.add_argument("--client-ca", help="mutual TLS: only callers with a certificate of this CA")
    ap.add_argument("--client-names", default="", help="comma-separated certificate names let in (default: any)")
    ap.add_argument("--allowed-registries", default=env.get("PODMIGRATE_ALLOWED_REGISTRIES", ""),
                    help="comma-separated host[:port][/path-prefix] (default: $PODMIGRATE_REGISTRY)")  # fmt: skip
    ap.add_argument("--namespaces", default=env.get("PODMIGRATE_NAMESPACES", ""), help="served (default: all)")
    ap.add_argument("--token-file", help="agent API token (default: $PODMIGRATE_AGENT_TOKEN)")
    args = ap.parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else env.get("PODMIGRATE_AGENT_TOKEN", "")
    if not args.node:
        sys.exit("podmigrate-k8s-agent: needs --node (or $NODE_NAME)")
    if bool(args.tls_cert) != bool(args.tls_key) or (args.client_ca and not args.tls_cert):
        sys.exit("podmigrate-k8s-agent: --tls-cert and --tls-key go together; --client-ca needs them")
    if not token and not args.client_ca:  # neither a token nor a certificate would let anyone in
        sys.exit("podmigrate-k8s-agent: needs --client-ca (mutual TLS) or a token ($PODMIGRATE_AGENT_TOKEN)")
    policy = Policy.from_env(
        {"PODMIGRATE_ALLOWED_REGISTRIES": args.allowed_registries, "PODMIGRATE_NAMESPACES": args.namespaces},
        env.get("PODMIGRATE_REGISTRY"),
    )
    if not policy.registries:
        sys.exit("podmigrate-k8s-agent: no registry allowed: set $PODMIGRATE_REGISTRY or --allowed-registries")
    if args.kubelet_insecure_tls:
        print("warning: --kubelet-insecure-tls: the kubelet is not verified; use --kubelet-ca", file=sys.stderr)
    kubelet = KubeletClient(args.kubelet, Path(args.kubelet_token_file), args.kubelet_ca, args.kubelet_insecure_tls)
    restores = Restores(Path(args.restore_dir), Path(args.restore_dir)) if args.restore_dir else None
    peers = parse_list(args.client_names) or None
    streams = None
    if restores is not None and args.stream_address:
        streams = Streams(restores, args.stream_address, runc_root=args.runc_root, checkpoint=args.runc_checkpoint)
    app = build_app(args.node, token, kubelet, Path(args.checkpoint_dir), restores, policy, peers, streams)
    tls = server_context(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
    server = serve(app, args.listen, tls)
    if args.health_listen:
        health = serve_health(args.health_listen)
        threading.Thread(target=health.serve_forever, name="health", daemon=True).start()
    scheme = "https" + (" (mutual TLS)" if args.client_ca else "") if tls else "http"
    print(f"podmigrate node agent {args.node} on {args.listen} ({scheme}), kubelet {args.kubelet}, "
          f"registries {', '.join(policy.registries)}", flush=True)  # fmt: skip
    server.serve_forever()


if __name__ == "__main__":
    main()
