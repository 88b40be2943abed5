"""A pod on a node, as the kubelet makes it: CRI configs from the pod spec, start, status, teardown.

Neighbours: ``kubelab.kubelet`` runs one ``PodWorker`` per pod bound to its node and writes
``status()`` back to the API; ``cri.CRIClient`` is the runtime. What a real kubelet does that this one
does not, because the lab has no use for it: CNI (every pod gets its node's network namespace, so its
IP is the node's), volumes, probes (Ready means every container runs), and restarts (an exited
container is reported terminated, not started again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from podmigrate.cri import api_pb2 as cri
from podmigrate.cri.client import CRIClient
from podmigrate.errors import CRIError, PodmigrateError

KUBELET_LABEL = "podmigrate.io/lab-kubelet"  # on every sandbox this kubelet made: its node's name
POD_LOGS = "/var/log/pods"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class PodWorker:
    """One incarnation of a pod (its ``uid``) on this node."""

    pod: dict[str, Any]
    node: str
    node_ip: str
    handler: str = ""  # the RuntimeClass handler, "" for the runtime's default
    sandbox: str | None = None
    containers: dict[str, str] = field(default_factory=dict)  # name -> CRI container id
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> containerStatus
    started_at: str = ""
    attempt: int = 0
    next_try: float = 0.0
    checked: float = 0.0  # when the containers' states were last read

    @property
    def uid(self) -> str:
        return str(self.pod["metadata"]["uid"])

    @property
    def key(self) -> tuple[str, str]:
        return self.pod["metadata"]["namespace"], self.pod["metadata"]["name"]

    # ------------------------------------------------------------------------------- CRI configs
    def sandbox_config(self) -> cri.PodSandboxConfig:
        meta = self.pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], self.uid
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=ns, attempt=self.attempt),
            log_directory=f"{POD_LOGS}/{ns}_{name}_{uid}",
            labels={
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": ns,
                "io.kubernetes.pod.uid": uid,
                KUBELET_LABEL: self.node,
            },
            # the kubelet passes the pod's annotations to the runtime; a RuntimeClass handler sees the
            # ones its allow-list names (this is how the podmigrate handler learns what to restore)
            annotations=dict(meta.get("annotations") or {}),
            linux=cri.LinuxPodSandboxConfig(
                security_context=cri.LinuxSandboxSecurityContext(
                    # no CNI in the lab: the node's network namespace (hostNetwork); PID per container
                    # (the kubelet's default without shareProcessNamespace)
                    namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
                )
            ),
        )

    def container_config(self, spec: dict[str, Any]) -> cri.ContainerConfig:
        meta = self.pod["metadata"]
        unsupported = sorted(set(spec) & {"volumeMounts", "volumeDevices", "envFrom"})
        if unsupported:
            raise PodmigrateError(
                f"container {spec['name']}: the lab's kubelet does not support {', '.join(unsupported)}",
                details={"reason": "CreateContainerConfigError"},
            )
        envs = [cri.KeyValue(key=e["name"], value=str(e.get("value", ""))) for e in spec.get("env") or []]
        return cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=spec["name"], attempt=0),
            image=cri.ImageSpec(image=spec["image"], user_specified_image=spec["image"]),
            command=list(spec.get("command") or []),
            args=list(spec.get("args") or []),
            working_dir=spec.get("workingDir", ""),
            envs=envs,
            labels={
                "io.kubernetes.container.name": spec["name"],
                "io.kubernetes.pod.name": meta["name"],
                "io.kubernetes.pod.namespace": meta["namespace"],
                "io.kubernetes.pod.uid": self.uid,
            },
            annotations={"io.kubernetes.container.restartCount": "0"},
            log_path=f"{spec['name']}/0.log",
        )

    # ----------------------------------------------------------------------------------- start
    def start(self, runtime: CRIClient, pull_timeout: float = 600) -> None:
        """Sandbox, then each container in order: pull (if not present), create, start. A failure is
        the container's waiting reason, as the kubelet reports it; the other containers still start."""
        self.started_at = self.started_at or now()
        config = self.sandbox_config()
        try:
            self.sandbox = runtime.run_pod_sandbox(config, runtime_handler=self.handler)
        except CRIError as e:
            for c in self.pod["spec"]["containers"]:
                self.statuses[c["name"]] = waiting(c, "CreatePodSandboxError", e.message)
            return
        for c in self.pod["spec"]["containers"]:
            name = c["name"]
            try:
                if c.get("imagePullPolicy") == "Always" or runtime.image_status(c["image"]) is None:
                    runtime.pull_image(c["image"], sandbox_config=config, timeout=pull_timeout)
            except CRIError as e:
                self.statuses[name] = waiting(c, "ErrImagePull", e.message)
                continue
            try:
                cid = runtime.create_container(self.sandbox, self.container_config(c), config)
                self.containers[name] = cid
                runtime.start_container(cid)
            except PodmigrateError as e:
                reason = e.details.get(
                    "reason", "CreateContainerError" if name not in self.containers else "RunContainerError"
                )
                self.statuses[name] = waiting(c, str(reason), e.message)
                continue
            self.statuses[name] = {**_base(c), "containerID": f"containerd://{cid}", "ready": True,
                                   "started": True, "state": {"running": {"startedAt": now()}}}  # fmt: skip

    def failed(self) -> bool:
        return any("waiting" in s["state"] for s in self.statuses.values())

    def refresh(self, runtime: CRIClient) -> None:
        """Notice containers that exited (the restored process may die later, like any process)."""
        for name, cid in self.containers.items():
            st = self.statuses.get(name) or {}
            if "running" not in st.get("state", {}):
                continue
            s = runtime.container_status(cid).status
            if s.state == cri.CONTAINER_EXITED:
                st["ready"] = False
                st["state"] = {"terminated": {"exitCode": s.exit_code, "reason": s.reason or "Error",
                                              "message": s.message, "finishedAt": now()}}  # fmt: skip

    def status(self) -> dict[str, Any]:
        spec = self.pod["spec"]["containers"]
        statuses = [self.statuses.get(c["name"]) or waiting(c, "ContainerCreating", "") for c in spec]
        ready = all(s["ready"] for s in statuses)
        running = all("running" in s["state"] for s in statuses)
        cond = "True" if ready else "False"
        return {
            "phase": "Running" if running else "Pending",
            "hostIP": self.node_ip,
            "podIP": self.node_ip,
            "podIPs": [{"ip": self.node_ip}],
            "startTime": self.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": cond},
                {"type": "Ready", "status": cond},
            ],
            "containerStatuses": statuses,
        }

    # -------------------------------------------------------------------------------- teardown
    def teardown(self, runtime: CRIClient, grace: int | None = None) -> None:
        """Stop (SIGTERM, then SIGKILL after the pod's grace period) and remove everything it made."""
        if grace is None:
            grace = int(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        for cid in self.containers.values():
            runtime.stop_container(cid, grace)
            runtime.remove_container(cid)
        if self.sandbox:
            runtime.stop_pod_sandbox(self.sandbox)
            runtime.remove_pod_sandbox(self.sandbox)
        self.containers.clear()
        self.sandbox = None


def _base(c: dict[str, Any]) -> dict[str, Any]:
    return {"name": c["name"], "image": c["image"], "restartCount": 0}


def waiting(c: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    return {**_base(c), "ready": False, "started": False, "state": {"waiting": {"reason": reason, "message": message}}}
