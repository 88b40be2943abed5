"""The Kubernetes API server, emulated: the one part of a cluster that cannot run on this machine.

No kube-apiserver binary exists for it (not in Debian, PyPI or npm). kmock's ``KubernetesEmulator``
(by kopf's author) serves the API's REST and watch protocol in memory, over HTTP on loopback, from
its own thread; the operator (kopf), the kubelets and the tests talk to it through real HTTP clients.
What it does not do, and the lab does not need: admission, RBAC, resourceVersion bookkeeping (the
objects kopf patches are given one, since kopf guards its JSON patches with a ``test`` of it), and
finalizer-gated deletion of pods (a pod is gone when deleted; the kubelet then tears it down).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import uuid
from typing import Any

from podmigrate.k8s import api as k

RESOURCES = {
    "podmigrate.io/v1alpha1/podlivemigrations": ("PodLiveMigration", True, ["status"]),
    "podmigrate.io/v1alpha1/nodeevacuations": ("NodeEvacuation", False, ["status"]),
    "v1/pods": ("Pod", True, ["status"]),
    "v1/services": ("Service", True, []),
    "v1/nodes": ("Node", False, ["status"]),
    "v1/events": ("Event", True, []),
    "v1/namespaces": ("Namespace", False, []),
    "node.k8s.io/v1/runtimeclasses": ("RuntimeClass", False, []),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, []),
}


class APIServer:
    """kmock's emulator on 127.0.0.1 of the calling thread's network namespace, in its own thread."""

    def __init__(self) -> None:
        self.url = ""
        self.emulator: Any = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="apiserver", daemon=True)

    def start(self) -> APIServer:
        self._thread.start()
        if not self._ready.wait(30) or self._failed:
            raise RuntimeError(f"the emulated API server did not start: {self._failed!r}")
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()
            self._failed = e
            self._ready.set()

    async def _serve(self) -> None:
        import kmock  # a test extra: only the lab's emulated cluster needs it

        class Emulator(kmock.KubernetesEmulator):
            """Plus what the API server adds on create: ``metadata.generateName`` (kopf names its Events
            so), a ``resourceVersion``, a ``uid`` (a kubelet tells a recreated pod from the old one by
            it) and a creation time."""

            async def _handle(self, request: Any) -> Any:
                meta = request.data.get("metadata") if isinstance(request.data, dict) else None
                if request.action == kmock.action.CREATE and meta is not None:
                    if meta.get("generateName") and not meta.get("name"):
                        meta["name"] = meta["generateName"] + secrets.token_hex(3)
                    meta.setdefault("uid", str(uuid.uuid4()))
                    meta.setdefault("resourceVersion", "1")
                    meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                return await super()._handle(request)

        self._stop = asyncio.Event()
        async with Emulator() as emu, kmock.Server(emu) as server:
            for res, (kind, namespaced, subresources) in RESOURCES.items():
                emu.resources[res] = kmock.ResourceInfo(
                    kind=kind,
                    namespaced=namespaced,
                    subresources=subresources,
                    verbs={"list", "watch", "get", "create", "patch", "update", "delete"},
                )
            self.emulator = emu
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 2.0)
                await self._compact(emu)

    @staticmethod
    async def _compact(emu: Any) -> None:
        """Forget what kmock keeps for a test's assertions and nothing here reads: every request it
        served and every soft-deleted object. Kept, they slow every call down over a long run (a
        benchmark makes hundreds of thousands of requests: the kubelets and the operator poll)."""
        emu._requests.clear()
        async with emu._lock:
            for key in [key for key, obj in emu._objects.items() if obj.deleted]:
                del emu._objects[key]

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def api(self) -> k.KubeAPI:
        return k.KubeAPI(k.KubeConfig(server=self.url, verify=False))
