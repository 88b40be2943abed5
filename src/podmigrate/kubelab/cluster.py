"""A Kubernetes cluster on a lab whose nodes run containerd (``lab up --runtime containerd``).

``KubeLab(lab, workdir).start()`` makes, in the lab's LAN network namespace (``kubelab.netns``):

- the API server (emulated: ``kubelab.apiserver``), the one part that cannot run here;
- ``localhost:5000``, the lab's registry under the name every node's containerd pulls from, so one
  image reference works for the agents that push and the runtimes that pull;
- a CA in ``workdir/pki`` (``podmigrate.pki``): the kubelets' serving certificates, each agent's and
  the operator's (every leaf serves and calls: mutual TLS);
- per node, a kubelet on that node's containerd (``kubelab.kubelet``) with a serving certificate and
  a token, and the podmigrate node agent (``k8s.agent``) that calls it, verifying the kubelet against
  the CA; the agent serves https to the operator's certificate only, and checks every request against
  the allowed registries; it runs beside the kubelet as a static pod would, and is in the API as its
  mirror pod;
- the RuntimeClass ``podmigrate`` (the node's restore handler, ``runtime.runc_restore``);
- the operator: ``kopf run -m podmigrate.k8s.operator``, in its own process, calling the agents over
  https with its client certificate and no token.

The calling thread stays in the LAN's namespace until ``close()``: from there the tests, the demo and
the bench reach the API server, the pods at their addresses and the registry. Used by
``tests/test_k8s.py``, ``podmigrate demo --kubernetes`` and ``podmigrate bench k8s``.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podmigrate import layout
from podmigrate.client import AgentClient
from podmigrate.errors import LabError
from podmigrate.k8s import agent as node_agent
from podmigrate.k8s import api as k
from podmigrate.k8s.kubelet import KubeletClient
from podmigrate.k8s.policy import Policy
from podmigrate.k8s.restores import Restores
from podmigrate.kubelab import netns
from podmigrate.kubelab.apiserver import APIServer
from podmigrate.kubelab.kubelet import MIRROR, Kubelet, KubeletConfig
from podmigrate.lab import containerd
from podmigrate.lab.cluster import Lab
from podmigrate.pki import CA, Identity

AGENT_NS = "podmigrate-system"
RUNTIME_CLASS = "podmigrate"
OPERATOR = "podmigrate-operator"  # the operator's certificate name: the only caller the agents let in


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed serving certificate for 127.0.0.1, its own CA (openssl): for tests that need one
    TLS endpoint and nothing else (``tests/tls_helpers.py``); the cluster itself uses its CA."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    if not cert.exists():
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        key.chmod(0o600)
    return cert, key


@dataclass
class Node:
    name: str
    kubelet: Kubelet
    agent: Any  # the agent's HTTP server
    checkpoints: Path  # the node's /var/lib/kubelet/checkpoints, seen from here


@dataclass
class KubeLab:
    lab: Lab
    workdir: Path
    kubelet_class: type[Kubelet] = Kubelet
    poll_s: float = 0.05
    operator_env: dict[str, str] = field(default_factory=dict)
    registry: str = f"{containerd.NODE_REGISTRY}/checkpoints"
    # where the operator and the agents let checkpoints go (None: ``registry`` alone)
    allowed_registries: list[str] | None = None
    kubelet_token: str = field(default_factory=lambda: secrets.token_hex(16))
    seal_master: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    nodes: dict[str, Node] = field(default_factory=dict)
    operator: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0

    def start(self) -> KubeLab:
        if self.lab.config().get("runtime") != "containerd":
            raise LabError(
                f"lab {self.lab.name!r} runs Podman; the Kubernetes lab needs containerd on its nodes",
                hint=f"podmigrate --lab {self.lab.name} lab down, then lab up --runtime containerd",
            )
        pid = self.lab.holder_pid()
        if pid is None:
            raise LabError(f"lab {self.lab.name!r} is not up", hint="podmigrate lab up --runtime containerd")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stack = ExitStack()
        self._stack.enter_context(netns.entered(netns.lan_path(pid)))
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        self.apiserver = APIServer().start()
        self._stack.callback(self.apiserver.stop)
        self.api = self.apiserver.api()
        self._stack.callback(self.api.close)
        relay = containerd.listen(5000)
        self._stack.callback(containerd.stop, relay)
        containerd.forward(relay, layout.REGISTRY)
        rc = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": RUNTIME_CLASS},
              "handler": containerd.RESTORE_HANDLER}  # fmt: skip
        self.api.create("/apis/node.k8s.io/v1/runtimeclasses", rc)
        self.ca = CA(self.workdir / "pki", "kubelab")
        self.operator_identity: Identity = self.ca.issue(OPERATOR)
        kubelet = self.ca.issue("kubelet", ips=["127.0.0.1"])
        for name in self.lab.nodes:
            self.add_node(name, kubelet.cert, kubelet.key)
        self.start_operator()

    def policy(self) -> Policy:
        return Policy.of(self.allowed_registries or [self.registry])

    def add_node(self, name: str, cert: Path, key: Path) -> Node:
        config = KubeletConfig(name, layout.node_ip(name), self.lab.dir / "cri" / f"{name}.sock",
                               self.kubelet_token, cert, key, poll_s=self.poll_s)  # fmt: skip
        kubelet = self.kubelet_class(config, self.api).start()
        self._stack.callback(kubelet.close)
        base = self.lab.dir / "nodes" / name
        checkpoints = base / "kubelet" / "checkpoints"
        client = KubeletClient(kubelet.url, self.kubelet_token, ca=str(self.ca.cert_path))
        # no token: only a caller with the operator's certificate gets past the handshake and the name check
        app = node_agent.build_app(
            name, "", client, checkpoints,
            restores=Restores(base / "podmigrate-restore", Path(containerd.RESTORE_DIR)),
            policy=self.policy(), peers=[OPERATOR],
        )  # fmt: skip
        ident = self.ca.issue(f"podmigrate-agent-{name}", ips=["127.0.0.1"])
        tls = node_agent.server_context(str(ident.cert), str(ident.key), client_ca=str(self.ca.cert_path))
        server = node_agent.serve(app, "127.0.0.1:0", tls)
        threading.Thread(target=server.serve_forever, name=f"agent-{name}", daemon=True).start()
        self._stack.callback(server.server_close)
        self._stack.callback(server.shutdown)
        port = server.server_address[1]
        self.api.create(k.pods(AGENT_NS), {
            "metadata": {"name": f"podmigrate-agent-{name}", "namespace": AGENT_NS,
                         "labels": {"app.kubernetes.io/name": "podmigrate-agent"},
                         "annotations": {MIRROR: "lab"}},
            "spec": {"nodeName": name, "containers": [{"name": "agent", "image": "podmigrate",
                     "ports": [{"name": "agent", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        })  # fmt: skip
        node = self.nodes[name] = Node(name, kubelet, server, checkpoints)
        return node

    def agent(self, node: str) -> AgentClient:
        """A client of ``node``'s agent, as the operator calls it (https, its certificate, no token)."""
        port = self.nodes[node].agent.server_address[1]
        tls = self.operator_identity.client_context()
        return AgentClient(node, None, "", 900.0, base_url=f"https://127.0.0.1:{port}", tls=tls)

    # ------------------------------------------------------------------------------ operator
    def start_operator(self) -> None:
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "PODMIGRATE_KUBE_SERVER": self.apiserver.url,
            "PODMIGRATE_AGENT_TOKEN": "",  # the certificate is the identity
            "PODMIGRATE_AGENT_CA": str(self.ca.cert_path),
            "PODMIGRATE_AGENT_CERT": str(self.operator_identity.cert),
            "PODMIGRATE_AGENT_KEY": str(self.operator_identity.key),
            "PODMIGRATE_REGISTRY": self.registry,
            "PODMIGRATE_SEAL_KEY": self.seal_master,  # what a Secret mounted only by the operator holds
            "PODMIGRATE_ALLOWED_REGISTRIES": ",".join(self.policy().registries),
            "PODMIGRATE_METRICS_PORT": str(self.metrics_port),
            "PODMIGRATE_POLL_S": str(self.poll_s),
            **self.operator_env,
        }
        kopf = Path(sys.executable).parent / "kopf"
        log = open(self.workdir / "operator.log", "ab")
        self.operator = subprocess.Popen(
            [str(kopf), "run", "--standalone", "--all-namespaces", "-m", "podmigrate.k8s.operator"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

    def stop_operator(self, kill: bool = False) -> None:
        p = self.operator
        if p is None or p.poll() is not None:
            return
        p.kill() if kill else p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def operator_log(self) -> str:
        path = self.workdir / "operator.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.stop_operator()
        self._stack.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 of the calling thread's network namespace."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
