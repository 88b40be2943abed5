"""What a Kubernetes cluster would provide and cannot run on this machine, for the operator tests.

Named as what they stand in for; everything else in these tests is real:

- ``KMock``: the Kubernetes API, kopf author's in-memory emulator (``kmock.KubernetesEmulator``) served
  over HTTP on loopback from its own thread; the operator (real kopf, in a subprocess) and the tests
  talk to it through real HTTP clients. It keeps no resourceVersions of its own, so the tests give the
  objects kopf patches one (kopf guards its JSON patches with a ``test`` of it).
- ``KubeletCheckpointEmulator``: a node's kubelet ``POST /checkpoint/{ns}/{pod}/{container}`` over HTTPS
  with bearer-token auth, per the documented API (200 with ``items``, 401, 404, 500). A "checkpoint"
  is a tar with CRI-O's archive layout whose memory pages are the container's emulated heap, so its
  SHA-256 can be compared after the restore.
- ``NodeSim``: the kubelets' pod lifecycle: marks pods Running and Ready on their node; for a pod whose
  image is a checkpoint image it pulls that image from the (real) registry with podmigrate's own
  verified pull, reads the heap out of the layer and records its SHA-256, as CRI-O's restore would
  bring the memory back.

The registry (``docker-registry``, Debian's distribution/distribution) and the node agents
(``podmigrate.k8s.agent``) are the real programs.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import secrets
import socket
import ssl
import subprocess
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock

from podmigrate.k8s import api as k
from podmigrate.transport import registry
from tests.conftest import wait_for

HEAP_FILE = "checkpoint/pages-1.img"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------ API server
class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API server's ``metadata.generateName`` (kopf names its Events so)."""

    async def _handle(self, request: Any) -> Any:
        meta = request.data.get("metadata") if isinstance(request.data, dict) else None
        if request.action == kmock.action.CREATE and meta and meta.get("generateName") and not meta.get("name"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        return await super()._handle(request)


class KMock:
    """The kmock Kubernetes emulator on 127.0.0.1, in a thread with its own event loop."""

    RESOURCES = {
        "podmigrate.io/v1alpha1/podlivemigrations": ("PodLiveMigration", True, ["status"]),
        "v1/pods": ("Pod", True, ["status"]),
        "v1/services": ("Service", True, []),
        "v1/nodes": ("Node", False, ["status"]),
        "v1/events": ("Event", True, []),
        "v1/namespaces": ("Namespace", False, []),
        "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, []),
    }

    def __init__(self) -> None:
        self.url = ""
        self.emulator: Any = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self) -> KMock:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock did not start")
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with _Emulator() as emu, kmock.Server(emu) as server:
            for res, (kind, namespaced, subresources) in self.RESOURCES.items():
                emu.resources[res] = kmock.ResourceInfo(
                    kind=kind,
                    namespaced=namespaced,
                    subresources=subresources,
                    verbs={"list", "watch", "get", "create", "patch", "update", "delete"},
                )
            self.emulator = emu
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def api(self) -> k.KubeAPI:
        return k.KubeAPI(k.KubeConfig(server=self.url, verify=False))


# ------------------------------------------------------------------------------------------ kubelet
def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


class KubeletCheckpointEmulator:
    """One node's kubelet Checkpoint API, over HTTPS with bearer-token auth."""

    def __init__(self, node: str, checkpoint_dir: Path, token: str, cert: Path, key: Path):
        self.node, self.dir, self.token = node, checkpoint_dir, token
        self.dir.mkdir(parents=True, exist_ok=True)
        self.heaps: dict[tuple[str, str, str], bytes] = {}  # (ns, pod, container) -> memory
        self.calls: list[tuple[str, str, str]] = []
        self.fail_with: int | None = None  # answer the next checkpoints with this status
        self.hold = threading.Event()  # cleared: checkpoints wait until it is set again
        self.hold.set()
        self.waiting = 0
        self.on_call: Callable[[], Any] | None = None  # runs at each checkpoint request, before it is served
        emu = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                m = re.match(r"^/checkpoint/([^/]+)/([^/]+)/([^/?]+)(\?timeout=\d+)?$", self.path)
                if self.headers.get("Authorization") != f"Bearer {emu.token}":
                    return self._send(401, {"message": "Unauthorized"})
                if not m:
                    return self._send(404, {"message": "404 page not found"})
                key = (m[1], m[2], m[3])
                emu.calls.append(key)
                if emu.on_call:
                    emu.on_call()
                emu.waiting += 1
                emu.hold.wait()
                emu.waiting -= 1
                if emu.fail_with:
                    return self._send(emu.fail_with, {"message": "checkpointing container failed: criu dump failed"})
                if key not in emu.heaps:
                    return self._send(404, {"message": f"container {key} not found"})
                path = emu.write_archive(*key)
                self._send(200, {"items": [str(path)]})

            def _send(self, status: int, body: dict[str, Any]) -> None:
                out = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def start_container(self, ns: str, pod: str, container: str, heap_bytes: int = 1 << 20) -> str:
        heap = os.urandom(heap_bytes)
        self.heaps[(ns, pod, container)] = heap
        return hashlib.sha256(heap).hexdigest()

    def write_archive(self, ns: str, pod: str, container: str) -> Path:
        """CRI-O's checkpoint archive layout: metadata files plus CRIU's image directory."""
        ts = time.strftime("%Y-%m-%dT%H:%M:%S")
        path = self.dir / f"checkpoint-{pod}_{ns}-{container}-{ts}.tar"
        heap = self.heaps[(ns, pod, container)]
        with tarfile.open(path, "w") as tar:
            for name, data in (
                ("config.dump", json.dumps({"id": f"{pod}-{container}", "name": container}).encode()),
                ("spec.dump", json.dumps({"annotations": {"io.kubernetes.pod.name": pod}}).encode()),
                (HEAP_FILE, heap),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------ registry
class Registry:
    """Debian's docker-registry (distribution) on loopback, deletes enabled."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        cfg = root / "config.yml"
        cfg.write_text(
            "version: 0.1\nlog: {level: error}\nstorage:\n  filesystem: {rootdirectory: "
            f"{root / 'data'}}}\n  delete: {{enabled: true}}\nhttp: {{addr: '127.0.0.1:{self.port}'}}\n"
        )
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(self._up, 30, "the registry to listen")

    def _up(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def has(self, reference: str) -> bool:
        host, repo, tag = registry.split_reference(reference)
        try:
            registry.Registry(host).get_manifest(repo, tag)
            return True
        except Exception:
            return False

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------------------------------ pods
class NodeSim:
    """The kubelets' side of pod lifecycle; restores checkpoint images by really pulling them."""

    def __init__(self, api: k.KubeAPI, registry_host: str, kubelets: dict[str, KubeletCheckpointEmulator]):
        self.api, self.registry_host, self.kubelets = api, registry_host, kubelets
        self.restored: dict[tuple[str, str], str] = {}  # (pod, container) -> SHA-256 of the restored heap
        self.fail_restore: str | None = None  # waiting reason to give restored pods instead of starting them
        self.lose_restored = False  # the target node "dies": restored pods vanish as they start
        self.errors: list[str] = []
        self.on_ready: Callable[[dict[str, Any]], Any] | None = None  # runs just before a pod turns ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for pod in self.api.list("/api/v1/pods"):
                    self._tend(pod)
            except Exception as e:  # kept for the test's failure message; the next round tries again
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(0.05)

    def _tend(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or meta.get("deletionTimestamp") or k.pod_ready(pod):
            return
        if self.lose_restored and "podmigrate.io/restored-by" in (meta.get("annotations") or {}):
            self.api.delete(k.pods(meta["namespace"], meta["name"]))  # its node died while it started
            return
        ns = meta["namespace"]
        statuses = []
        for c in spec["containers"]:
            image = c["image"]
            if image.startswith(self.registry_host + "/"):
                if self.fail_restore:
                    statuses.append({"name": c["name"], "ready": False, "state": {"waiting": {
                        "reason": self.fail_restore, "message": "criu restore failed: see restore.log"}}})  # fmt: skip
                    continue
                heap = self._restore(image)
                self.restored[(meta["name"], c["name"])] = hashlib.sha256(heap).hexdigest()
                if node in self.kubelets:  # the restored process lives on the target with that memory
                    self.kubelets[node].heaps[(ns, meta["name"], c["name"])] = heap
            elif node in self.kubelets:  # a fresh start: new memory
                self.kubelets[node].start_container(ns, meta["name"], c["name"])
            statuses.append({"name": c["name"], "ready": True, "state": {"running": {}}})
        ready = all(s["ready"] for s in statuses)
        if ready and self.on_ready:
            self.on_ready(pod)
        status = {
            "phase": "Running" if ready else "Pending",
            "podIP": f"10.0.0.{zlib.crc32(meta['name'].encode()) % 200 + 2}",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": statuses,
        }
        self.api.patch(k.pods(ns, meta["name"]) + "/status", {"status": status})

    def _restore(self, image: str) -> bytes:
        with tempfile.TemporaryDirectory() as d:
            dest = Path(d) / "layer.tar"
            registry.pull_checkpoint(image, dest)  # verifies the layer's digest
            with tarfile.open(dest) as tar:
                f = tar.extractfile(HEAP_FILE)
                assert f is not None
                return f.read()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ------------------------------------------------------------------------------------------ operator
class Operator:
    """The real operator: ``kopf run -m podmigrate.k8s.operator`` in a subprocess."""

    def __init__(self, env: dict[str, str], log: Path):
        self.env, self.log = env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Operator:
        kopf = Path(os.environ.get("VIRTUAL_ENV", Path(__file__).parents[1] / ".venv")) / "bin" / "kopf"
        f = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [str(kopf), "run", "--standalone", "--all-namespaces", "-m", "podmigrate.k8s.operator"],
            env={**os.environ, **self.env},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
