"""A small kubelet for one lab node: the pods bound to it run in that node's containerd, over CRI.

What it does, as the kubelet does it:

- registers its Node (Ready, InternalIP, ``nodeInfo.containerRuntimeVersion`` from CRI ``Version``,
  so the operator can tell which restore path the runtime has);
- runs the pods bound to the node (``spec.nodeName``): ``RunPodSandbox``, ``PullImage``,
  ``CreateContainer``, ``StartContainer`` (``kubelab.pods``), writes phase, pod IP and container
  statuses back, retries a failed pod with back-off, and stops and removes a deleted pod's
  containers and sandbox; a ``runtimeClassName`` picks the RuntimeClass's CRI handler;
- serves the Checkpoint API (KEP-2008) over HTTPS with a bearer token:
  ``POST /checkpoint/{namespace}/{pod}/{container}?timeout=S`` calls CRI ``CheckpointContainer``
  into ``/var/lib/kubelet/checkpoints/checkpoint-<pod>_<namespace>-<container>-<RFC 3339>.tar`` and
  answers ``{"items": [path]}``; 401 without the token, 404 for a pod or container not running here,
  500 with the runtime's message when the checkpoint fails.

It runs on the host beside the lab (the lab's nodes have no grpcio) and reaches its node's containerd
through the CRI socket in the lab's state directory.
"""

from __future__ import annotations

import hmac
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from podmigrate.cri.client import CRIClient
from podmigrate.errors import CRIError, PodmigrateError
from podmigrate.k8s import api as k
from podmigrate.kubelab.pods import KUBELET_LABEL, PodWorker, waiting

CHECKPOINTS = "/var/lib/kubelet/checkpoints"  # on the node
MIRROR = "kubernetes.io/config.mirror"  # a static pod's mirror: the kubelet runs the pod, not from the API
EVICTION_KIB = 100 << 10  # the kubelet's default hard eviction threshold, memory.available < 100Mi


def total_kib() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1])  # MemTotal


_PATH = re.compile(r"^/checkpoint/([a-z0-9.-]{1,253})/([a-z0-9.-]{1,253})/([a-z0-9-]{1,63})(?:\?timeout=(\d+))?$")


class KubeletError(PodmigrateError):
    """An answer of the Checkpoint API other than 200: ``details['status']``."""


@dataclass
class KubeletConfig:
    node: str
    node_ip: str
    cri_socket: Path
    token: str
    cert: Path  # the kubelet's serving certificate and key
    key: Path
    poll_s: float = 0.1
    kubelet_version: str = "v1.34.0-podmigrate-lab"


class Kubelet:
    def __init__(self, config: KubeletConfig, api: k.KubeAPI) -> None:
        self.config, self.api = config, api
        self.cri = CRIClient(config.cri_socket, timeout=300)
        self.workers: dict[str, PodWorker] = {}  # pod uid -> worker
        self.busy: set[str] = set()  # uids with a start or teardown running
        self.errors: list[str] = []  # the loop's failures, newest last (it retries; tests print them)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(config.cert, config.key)
        self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> Kubelet:
        self._clean_leftovers()
        self.register()
        for target, name in ((self.server.serve_forever, "api"), (self._loop, "sync")):
            t = threading.Thread(target=target, name=f"kubelet-{self.config.node}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def register(self) -> None:
        v = self.cri.version()
        node = {
            "metadata": {"name": self.config.node, "labels": {"kubernetes.io/hostname": self.config.node}},
            "status": {
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                "addresses": [
                    {"type": "InternalIP", "address": self.config.node_ip},
                    {"type": "Hostname", "address": self.config.node},
                ],
                # what a kubelet reports; the lab's nodes share this machine's memory, so each says all of it
                "capacity": {"memory": f"{total_kib()}Ki", "pods": "110"},
                "allocatable": {"memory": f"{max(0, total_kib() - EVICTION_KIB)}Ki", "pods": "110"},
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.server.server_address[1]}},
                "nodeInfo": {
                    "containerRuntimeVersion": f"{v.runtime_name}://{v.runtime_version}",
                    "kubeletVersion": self.config.kubelet_version,
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        }
        if self.api.get(k.nodes(self.config.node)) is None:
            self.api.create(k.nodes(), node)
        else:
            self.api.patch(k.nodes(self.config.node) + "/status", {"status": node["status"]})

    def _clean_leftovers(self) -> None:
        """Sandboxes an earlier kubelet of this node made: their pods are not this cluster's."""
        for sb in self.cri.list_pod_sandbox({KUBELET_LABEL: self.config.node}):
            self.cri.stop_pod_sandbox(sb.id)
            self.cri.remove_pod_sandbox(sb.id)

    def close(self) -> None:
        """Stop serving and tear down every pod this kubelet runs."""
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        for t in self._threads:
            t.join(30)
        for w in list(self.workers.values()):
            try:
                w.teardown(self.cri, grace=2)
            except CRIError as e:
                self.errors.append(f"teardown of {w.key}: {e.message}")
        self.cri.close()

    # ------------------------------------------------------------------------------ checkpoint API
    def checkpoint(self, namespace: str, pod: str, container: str, timeout: int) -> str:
        """CRI ``CheckpointContainer`` of a running container; the archive's path on the node."""
        worker = next((w for w in self.workers.values() if w.key == (namespace, pod)), None)
        cid = worker.containers.get(container) if worker else None
        if worker is None or cid is None or "running" not in worker.statuses.get(container, {}).get("state", {}):
            raise KubeletError(f"container {namespace}/{pod}/{container} is not running on {self.config.node}",
                               details={"status": 404})  # fmt: skip
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path = f"{CHECKPOINTS}/checkpoint-{pod}_{namespace}-{container}-{stamp}.tar"
        try:
            self.cri.checkpoint_container(cid, path, timeout=timeout)
        except CRIError as e:
            raise KubeletError(f"checkpointing of {namespace}/{pod}/{container} failed ({e.message})",
                               details={"status": 500}) from e  # fmt: skip
        return path

    # ------------------------------------------------------------------------------ pod sync
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except PodmigrateError as e:  # the API or the runtime away for a moment: the next round retries
                self.errors.append(e.message)
            self._stop.wait(self.config.poll_s)

    def sync(self) -> None:
        pods = [
            p
            for p in self.api.list("/api/v1/pods", field_selector=f"spec.nodeName={self.config.node}")
            if (p.get("spec") or {}).get("nodeName") == self.config.node  # field selectors: a courtesy
            and not p["metadata"].get("deletionTimestamp")
            and MIRROR not in (p["metadata"].get("annotations") or {})  # run outside the API, not by us
        ]
        bound = {p["metadata"]["uid"]: p for p in pods}
        with self._lock:
            for uid, pod in bound.items():
                if uid in self.busy:
                    continue
                w = self.workers.get(uid)
                if w is None:
                    w = self.workers[uid] = PodWorker(pod, self.config.node, self.config.node_ip)
                    self._spawn(uid, self._start, w)
                elif w.failed() and time.monotonic() >= w.next_try:
                    self._spawn(uid, self._retry, w)
                elif w.containers and time.monotonic() - w.checked > 1.0:
                    w.checked = time.monotonic()
                    self._spawn(uid, self._refresh, w)
            for uid in [u for u in self.workers if u not in bound and u not in self.busy]:
                self._spawn(uid, self._teardown, self.workers[uid])

    def _spawn(self, uid: str, fn: Any, w: PodWorker) -> None:
        self.busy.add(uid)

        def run() -> None:
            try:
                fn(w)
            except PodmigrateError as e:
                self.errors.append(f"{w.key}: {e.message}")
            finally:
                with self._lock:
                    self.busy.discard(uid)

        threading.Thread(target=run, name=f"kubelet-{self.config.node}-{uid[:8]}", daemon=True).start()

    def _start(self, w: PodWorker) -> None:
        handler = self._handler_of(w)
        if handler is not None:
            w.handler = handler
            w.start(self.cri)
        self._write_status(w)
        if w.failed():
            w.attempt += 1
            w.next_try = time.monotonic() + min(2.0**w.attempt, 20.0)  # the kubelet's back-off, shortened

    def _retry(self, w: PodWorker) -> None:
        w.teardown(self.cri, grace=0)
        w.statuses.clear()
        self._start(w)

    def _refresh(self, w: PodWorker) -> None:
        before = json.dumps(w.statuses, sort_keys=True)
        w.refresh(self.cri)
        if json.dumps(w.statuses, sort_keys=True) != before:
            self._write_status(w)

    def _teardown(self, w: PodWorker) -> None:
        w.teardown(self.cri)  # a runtime that is down raises: the pod stays listed, the next round retries
        self.workers.pop(w.uid, None)

    def _handler_of(self, w: PodWorker) -> str | None:
        """The CRI handler of the pod's RuntimeClass ("" for none); None when the class does not exist."""
        name = w.pod["spec"].get("runtimeClassName")
        if not name:
            return ""
        rc = self.api.get(f"/apis/node.k8s.io/v1/runtimeclasses/{name}")
        if rc is None:
            for c in w.pod["spec"]["containers"]:
                w.statuses[c["name"]] = waiting(c, "CreatePodSandboxError", f"RuntimeClass {name!r} not found")
            return None
        return str(rc.get("handler", ""))

    def _write_status(self, w: PodWorker) -> None:
        ns, name = w.key
        current = self.api.get(k.pods(ns, name))
        if current is None or current["metadata"].get("uid") != w.uid:
            return  # deleted (and perhaps recreated) meanwhile: the next round tears this one down
        self.api.patch(k.pods(ns, name) + "/status", {"status": w.status()})


def _handler(kubelet: Kubelet) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            auth = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(auth.encode(), f"Bearer {kubelet.config.token}".encode()):
                return self._send(401, {"kind": "Status", "message": "Unauthorized"})
            m = _PATH.fullmatch(self.path)
            if not m:
                return self._send(404, {"kind": "Status", "message": "404 page not found"})
            try:
                path = kubelet.checkpoint(m[1], m[2], m[3], int(m[4] or 0))
            except KubeletError as e:
                return self._send(int(e.details["status"]), {"kind": "Status", "message": e.message})
            self._send(200, {"items": [path]})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            out = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    return H
