"""A real Kubernetes control plane in a lab: etcd (Debian's, in the node image) and upstream's
kube-apiserver, kube-controller-manager and kube-scheduler at the pinned release (``kube.build``),
on the lab's LAN (the API server at https://10.77.0.1:6443), with TLS from the cluster's CA
(``kube.certs``), the Node and RBAC authorizers and the default admission plugins; and upstream's
kubelet on every node, over the node's containerd (``kube.kubelet``).

Each component runs inside the lab (its mount namespace, the LAN's network namespace) and in the
lab's cgroup, so ``lab down`` ends it with the rest; it is known by its pid file (pid and start
time, ``procs``). ``up`` is idempotent: what runs is left, what died is started again. Everything
lives in ``<lab>/kube``: binaries (hard links to the build cache), pki, etcd's data, logs.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from podmigrate import layout, procs
from podmigrate.errors import LabError, UsageError
from podmigrate.kube import build, certs, kubelet
from podmigrate.kube.certs import Paths
from podmigrate.lab.cluster import Lab
from podmigrate.lab.host import join

Report = Callable[[str], None]
ETCD = "https://127.0.0.1:2379"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def _usual_umask(then: Callable[[], None]) -> None:
    """A component's files (the kubelet's pod directories) as upstream expects them, whatever the
    umask of the process that started it (the tests run under 077)."""
    os.umask(0o022)
    then()


class KubeCluster:
    def __init__(self, lab: Lab):
        self.lab = lab
        self.paths = Paths(lab.dir / "kube")

    # ------------------------------------------------------------------ files
    def _bin(self, name: str) -> str:
        return "/usr/bin/etcd" if name == "etcd" else f"{self.paths.lab}/bin/{name}"

    def _link_binaries(self, source: Path) -> None:
        """The built binaries into the lab's state (hard links: same file system, no copy)."""
        dest = self.paths.host / "bin"
        dest.mkdir(parents=True, exist_ok=True)
        for name in build.COMPONENTS:
            target = dest / name
            tmp = dest / f".{name}.new"
            tmp.unlink(missing_ok=True)
            try:
                os.link(source / name, tmp)
            except OSError:  # another file system
                shutil.copy2(source / name, tmp)
            tmp.replace(target)

    def _pidfile(self, name: str) -> Path:
        return self.lab.dir / "pids" / f"kube-{name}.pid"

    def running(self, name: str) -> procs.Proc | None:
        p = procs.read_pidfile(self._pidfile(name))
        ok = p is not None and procs.running(p) and procs.in_cgroup(p.pid, self.lab.cgroup_path)
        return p if ok else None

    # ------------------------------------------------------------------ processes
    def _argv(self, name: str) -> list[str]:
        pki = f"{self.paths.lab}/pki"
        kc = f"{self.paths.lab}"
        if name == "etcd":
            return [self._bin(name), "--name", "lab", "--data-dir", f"{self.paths.lab}/etcd",
                    "--listen-client-urls", ETCD, "--advertise-client-urls", ETCD,
                    "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls",
                    "http://127.0.0.1:2380", "--initial-cluster", "lab=http://127.0.0.1:2380",
                    "--listen-metrics-urls", "http://127.0.0.1:2381",
                    "--cert-file", f"{pki}/etcd.crt", "--key-file", f"{pki}/etcd.key",
                    "--client-cert-auth", "--trusted-ca-file", f"{pki}/ca.crt"]  # fmt: skip
        if name == "kube-apiserver":
            return [self._bin(name), "--advertise-address", layout.LAN_GATEWAY,
                    "--bind-address", "0.0.0.0", "--secure-port", str(certs.API_PORT),
                    "--etcd-servers", ETCD, "--etcd-cafile", f"{pki}/ca.crt",
                    "--etcd-certfile", f"{pki}/apiserver-etcd-client.crt",
                    "--etcd-keyfile", f"{pki}/apiserver-etcd-client.key",
                    "--tls-cert-file", f"{pki}/kube-apiserver.crt",
                    "--tls-private-key-file", f"{pki}/kube-apiserver.key",
                    "--client-ca-file", f"{pki}/ca.crt", "--authorization-mode", "Node,RBAC",
                    "--enable-admission-plugins", "NodeRestriction", "--allow-privileged",
                    "--anonymous-auth=false",
                    "--service-account-key-file", f"{pki}/sa.pub",
                    "--service-account-signing-key-file", f"{pki}/sa.key",
                    "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                    "--service-cluster-ip-range", certs.SERVICE_CIDR,
                    "--kubelet-client-certificate", f"{pki}/apiserver-kubelet-client.crt",
                    "--kubelet-client-key", f"{pki}/apiserver-kubelet-client.key",
                    "--kubelet-certificate-authority", f"{pki}/ca.crt",
                    "--kubelet-preferred-address-types", "InternalIP",
                    "--requestheader-client-ca-file", f"{pki}/ca.crt",
                    "--requestheader-allowed-names", "front-proxy-client",
                    "--requestheader-username-headers", "X-Remote-User",
                    "--requestheader-group-headers", "X-Remote-Group",
                    "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
                    "--proxy-client-cert-file", f"{pki}/front-proxy-client.crt",
                    "--proxy-client-key-file", f"{pki}/front-proxy-client.key",
                    # Services of webhooks dialled at their endpoints: this LAN has no kube-proxy
                    "--enable-aggregator-routing=true",
                    "--profiling=false"]  # fmt: skip
        if name not in ("kube-controller-manager", "kube-scheduler"):
            raise ValueError(name)
        # both: their own kubeconfig for the API and for checking their callers, /healthz served with
        # a certificate of the cluster's CA, on loopback, one instance (no leader election)
        common = [self._bin(name), "--kubeconfig", f"{kc}/{name}.kubeconfig",
                  "--authentication-kubeconfig", f"{kc}/{name}.kubeconfig",
                  "--authorization-kubeconfig", f"{kc}/{name}.kubeconfig",
                  "--tls-cert-file", f"{pki}/{name}-serving.crt", "--tls-private-key-file", f"{pki}/{name}-serving.key",
                  "--bind-address", "127.0.0.1", "--leader-elect=false", "--profiling=false"]  # fmt: skip
        if name == "kube-scheduler":
            return common
        return [*common, "--use-service-account-credentials",
                "--service-account-private-key-file", f"{pki}/sa.key", "--root-ca-file", f"{pki}/ca.crt",
                "--cluster-signing-cert-file", f"{pki}/ca.crt", "--cluster-signing-key-file", f"{pki}/ca.key",
                "--allocate-node-cidrs", "--cluster-cidr", certs.CLUSTER_CIDR, "--node-cidr-mask-size", "24",
                "--service-cluster-ip-range", certs.SERVICE_CIDR]  # fmt: skip

    def _start(self, name: str, target: str = "lan", argv: list[str] | None = None) -> procs.Proc:
        cmd, cg = self.lab.command(target, argv or self._argv(name))
        logs = self.paths.host / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=lambda: _usual_umask(join(cg)))  # fmt: skip
        p = procs.write_pidfile(self._pidfile(name), proc.pid)
        if p is None:
            raise LabError(f"{name} exited at once", hint=f"its log: {logs / f'{name}.log'}")
        return p

    def _wait(self, name: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.running(name) is None or time.monotonic() > deadline:
                log = self.paths.host / "logs" / f"{name}.log"
                tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
                raise LabError(
                    f"{name} did not become ready in lab {self.lab.name!r}",
                    hint=f"its log: {log}",
                    details={"log_tail": tail},
                )
            time.sleep(0.2)

    def _curl(self, url: str, file: str = "admin") -> bool:
        return self._read(url, file) is not None

    def _read(self, url: str, file: str = "admin") -> str | None:
        """``url``'s body with ``file``'s identity, from the LAN; None when it does not answer 2xx."""
        ident = certs.identity(self.paths, file)
        argv = ["curl", "-sf", "--max-time", "2", "--cacert", self.paths.inside(ident.ca),
                "--cert", self.paths.inside(ident.cert), "--key", self.paths.inside(ident.key), url]  # fmt: skip
        p = self.lab.run("lan", argv, check=False)
        return p.stdout if p.returncode == 0 else None

    def _kubelet_knows_its_pods(self, node: str) -> bool:
        """Whether the kubelet on ``node`` has taken in every pod the API binds to it: until then a
        restarted kubelet answers its checkpoint endpoint 404 "pod does not exist"."""
        body = self._read(f"https://{layout.node_ip(node)}:{kubelet.PORT}/pods", "apiserver-kubelet-client")
        if body is None:
            return False
        known = {p["metadata"]["uid"] for p in json.loads(body).get("items") or []}
        bound = self.kubectl(["get", "pods", "-A", "--field-selector", f"spec.nodeName={node}", "-o", "json"], False)
        return bound.returncode == 0 and {p["metadata"]["uid"] for p in json.loads(bound.stdout)["items"]} <= known

    # ------------------------------------------------------------------ up, down, status
    def up(self, report: Report = lambda _m: None) -> dict[str, Any]:
        self.lab.require_up()
        if self.lab.config().get("runtime") != "containerd":
            raise LabError(
                f"lab {self.lab.name!r} runs Podman alone; the kubelets need containerd on its nodes",
                hint=f"podmigrate --lab {self.lab.name} lab down, then lab up --runtime containerd",
            )
        if not Path(self.lab.image.root, "usr/bin/etcd").exists():
            raise LabError(
                f"lab {self.lab.name!r} runs on a node image without etcd",
                hint="take the lab down and up again: a new node image (with etcd) is built",
            )
        if not build.ready():
            report(f"building Kubernetes {build.pinned_version()} (once per pin; tens of minutes on 2 cores)")
        binaries = build.ensure(lambda c, i, n: report(f"building {c} ({i}/{n})"))
        self._link_binaries(binaries)
        report("the cluster's certificates and kubeconfigs")
        certs.issue(self.paths, self.lab.nodes)
        for file, (user, _groups) in certs.CLIENTS.items():
            certs.kubeconfig(self.paths, file, user)
        certs.kubeconfig(self.paths, "admin", "kubernetes-admin", inside=False)
        checks: dict[str, tuple[Callable[[], bool], float]] = {
            "etcd": (lambda: self._curl(f"{ETCD}/health", "apiserver-etcd-client"), 60),
            "kube-apiserver": (lambda: self._curl(f"{certs.API_SERVER}/readyz"), 180),
            "kube-controller-manager": (lambda: self._curl("https://127.0.0.1:10257/healthz"), 120),
            "kube-scheduler": (lambda: self._curl("https://127.0.0.1:10259/healthz"), 120),
        }
        for name in CONTROL_PLANE:
            if self.running(name) is None:
                report(f"starting {name}")
                self._start(name)
            ready, timeout = checks[name]
            self._wait(name, ready, timeout)
        for node in self.lab.nodes:
            self._kubelet(node, report)
        self._pod_routes()
        return self.status()

    def _kubelet(self, node: str, report: Report) -> None:
        """Upstream's kubelet on ``node`` (``kube.kubelet``), until its Node is Ready."""
        name = f"kubelet-{node}"
        if self.running(name) is None:
            report(f"starting the kubelet on {node}")
            conf = certs.kubeconfig(self.paths, name, f"system:node:{node}")
            kubelet.write_config(self.paths, node, self.pleg())
            self.lab.run(node, ["sh", "-c", kubelet.shadow_script()])
            self._start(name, node, kubelet.argv(self.paths, node, conf))
        # the node registers NotReady (no pod network yet) and the controller-manager gives it a
        # podCIDR; the network made for that, containerd reports the network ready, and so the node
        self._wait(name, lambda: bool(self.pod_cidr(node)), 120)
        self._pod_network(node, self.pod_cidr(node))
        self._wait(name, lambda: self.node_ready(node), 120)
        proxy = f"kube-proxy-{node}"
        if self.running(proxy) is None:
            report(f"starting kube-proxy on {node}")
            proxy_conf = kubelet.proxy_config(self.paths, node, self.paths.host / "kube-proxy.kubeconfig")
            self._start(proxy, node, [f"{self.paths.lab}/bin/kube-proxy", "--config", proxy_conf, "--v=1"])
        self._wait(proxy, lambda: self.lab.run(node, ["curl", "-sf", "-o", "/dev/null", "--max-time", "2",
                                                      "http://127.0.0.1:10256/healthz"], check=False).returncode == 0,
                   60)  # fmt: skip

    def pleg(self) -> str:
        """How the kubelets learn of container changes: ``generic`` (a relist every second) or ``evented``."""
        f = self.paths.host / "pleg"
        return f.read_text().strip() if f.exists() else "generic"

    def set_pleg(self, pleg: str, report: Report = lambda _m: None) -> None:
        """Every kubelet restarted with ``pleg`` (no pod is stopped: the runtime keeps them running)."""
        if pleg not in kubelet.PLEGS:
            raise UsageError(f"no PLEG named {pleg!r}", hint=f"choose one of: {', '.join(kubelet.PLEGS)}")
        if pleg == self.pleg() and all(self.running(f"kubelet-{n}") for n in self.lab.nodes):
            return
        (self.paths.host / "pleg").write_text(pleg + "\n")
        for node in self.lab.nodes:
            p = self.running(f"kubelet-{node}")
            if p is not None:
                report(f"restarting the kubelet on {node} with the {pleg} PLEG")
                procs.stop(p, self.lab.cgroup_path)
            self._kubelet(node, report)
            self._wait(f"kubelet-{node}", functools.partial(self._kubelet_knows_its_pods, node), 120)

    def pod_cidr(self, node: str) -> str:
        p = self.kubectl(["get", "node", node, "-o", "jsonpath={.spec.podCIDR}"], check=False)
        return p.stdout.strip() if p.returncode == 0 else ""

    def _pod_network(self, node: str, cidr: str) -> None:
        """The bridge CNI on ``node`` for the podCIDR the controller-manager gave it, and its LAN route."""
        conf = self.lab.dir / "nodes" / node / "cni-net.d" / "10-podmigrate.conflist"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(kubelet.conflist(cidr))
        self.lab.run("lan", ["ip", "route", "replace", cidr, "via", layout.node_ip(node)])

    def _pod_routes(self) -> None:
        """Each node's podCIDR routed on every other node straight to that node's address (host-gw):
        node-to-pod and pod-to-pod across nodes without the LAN's namespace forwarding, which would
        also forward between the nodes' Podman workloads."""
        cidrs = {n: self.pod_cidr(n) for n in self.lab.nodes}
        for node in self.lab.nodes:
            for other, cidr in cidrs.items():
                if other != node and cidr:
                    self.lab.run(node, ["ip", "route", "replace", cidr, "via", layout.node_ip(other)])

    def _drop_pod_routes(self, where: str) -> None:
        for line in self.lab.run(where, ["ip", "route", "show"]).stdout.splitlines():
            dst = line.split()[0]
            if (
                " via " in line
                and dst != "default"
                and ipaddress.IPv4Network(dst).subnet_of(ipaddress.IPv4Network(layout.POD_SUBNET))
            ):
                self.lab.run(where, ["ip", "route", "del", dst], check=False)

    def node_ready(self, node: str) -> bool:
        p = self.kubectl(["get", "node", node, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"],
                         check=False)  # fmt: skip
        return p.returncode == 0 and p.stdout.strip() == "True"

    def down(self, report: Report = lambda _m: None) -> None:
        if self.running("kube-apiserver") and any(self.running(f"kubelet-{n}") for n in self.lab.nodes):
            report("deleting every pod (their kubelets stop them)")
            self.kubectl(["delete", "pods", "--all", "--all-namespaces", "--wait", "--timeout=120s"], check=False)
        for node in self.lab.nodes:  # the pod network goes with the cluster
            (self.lab.dir / "nodes" / node / "cni-net.d" / "10-podmigrate.conflist").unlink(missing_ok=True)
        for where in ["lan", *self.lab.nodes]:
            self._drop_pod_routes(where)
        node_side = [f"{c}-{n}" for n in self.lab.nodes for c in ("kube-proxy", "kubelet")]
        for name in [*node_side, *reversed(CONTROL_PLANE)]:
            p = self.running(name)
            if p is not None:
                report(f"stopping {name}")
                procs.stop(p, self.lab.cgroup_path)
            self._pidfile(name).unlink(missing_ok=True)
        if self.paths.host.exists():
            report(f"removing {self.paths.host}")
            shutil.rmtree(self.paths.host)

    def status(self) -> dict[str, Any]:
        names = [*CONTROL_PLANE, *(f"{c}-{n}" for n in self.lab.nodes for c in ("kubelet", "kube-proxy"))]
        out: dict[str, Any] = {"lab": self.lab.name, "server": certs.API_SERVER,
                               "components": {n: bool(self.running(n)) for n in names}}  # fmt: skip
        if out["components"]["kube-apiserver"]:
            p = self.kubectl(["version", "-o", "json"], check=False)
            with contextlib.suppress(ValueError):
                out["version"] = json.loads(p.stdout).get("serverVersion", {}).get("gitVersion")
        return out

    def kubeconfig(self) -> Path:
        """The admin's kubeconfig, host paths: usable from the lab's LAN (``kubectl``)."""
        path = self.paths.host / "admin.host.kubeconfig"
        if not path.exists():
            raise LabError(f"lab {self.lab.name!r} has no Kubernetes cluster", hint="podmigrate kube up")
        return path

    def kubectl(
        self, args: Sequence[str], check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """kubectl of the pinned release, run in the lab's LAN with the admin's kubeconfig."""
        p = subprocess.run(self.kubectl_argv(args), capture_output=True, text=True, input=input, timeout=timeout)
        if check and p.returncode:
            raise LabError(
                f"kubectl {' '.join(args)} failed (exit {p.returncode})",
                details={"stderr": p.stderr[-3000:], "stdout": p.stdout[-3000:]},
            )
        return p

    def kubectl_argv(self, args: Sequence[str]) -> list[str]:
        """The host argv of ``kubectl ARGS`` in the lab's LAN (for output that streams: ``get -w``)."""
        pid = self.lab.holder_pid()
        if pid is None:
            raise LabError(f"lab {self.lab.name!r} is not up", hint="podmigrate lab up --runtime containerd")
        return ["nsenter", f"--net=/proc/{pid}/root/run/netns/lan", str(self.paths.host / "bin" / "kubectl"),
                "--kubeconfig", str(self.kubeconfig()), *args]  # fmt: skip
