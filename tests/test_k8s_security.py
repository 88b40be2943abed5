"""Issue 13, item 7: each Kubernetes attack tried for real, without a lab, and refused.

Real: the operator's validate and runner, on a fake API (``tests/fake_kube.py``, in memory); the node
agent's https listener with a CA from ``podmigrate.pki``, a kubelet stand-in serving a certificate of
that CA (the agent verifies it), and a distribution registry (``docker-registry``, plain HTTP on
loopback). Refused: a foreign ``spec.registry``, a namespace not served, a caller without the
operator's certificate, a push, delete or restore outside the agent's allow-list; and a tag moved
after the push is not what gets restored.
"""

from __future__ import annotations

import io
import json
import os
import ssl
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from podmigrate.client import AgentClient
from podmigrate.errors import AgentError, PodmigrateError
from podmigrate.k8s import agent as node_agent
from podmigrate.k8s import api as k
from podmigrate.k8s import controller, phases
from podmigrate.k8s.context import LOCK, K8sRecord
from podmigrate.k8s.kubelet import KubeletClient
from podmigrate.k8s.policy import Policy, Refused, by_digest
from podmigrate.k8s.restores import Restores
from podmigrate.pki import CA
from podmigrate.transport import registry, seal
from tests.conftest import wait_for
from tests.fake_kube import FakeKubeAPI
from tests.tls_helpers import free_port

OURS = "localhost:5000/checkpoints"


# ------------------------------------------------------------------------------ the allow-list
@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("localhost:5000/checkpoints", True),
        ("localhost:5000/checkpoints/default-web-server:20260101-abc", True),
        ("localhost:5000/checkpoints/team/x@sha256:" + "a" * 64, True),
        ("localhost:5000/checkpoints-evil/x:1", False),  # a prefix by component, not by character
        ("localhost:5000/other/x:1", False),
        ("localhost:5001/checkpoints/x:1", False),  # the host exactly, port included
        ("evil.example/checkpoints/x:1", False),
        ("localhost:5000/checkpoints/../loot/x:1", False),  # no component a registry might resolve
        ("localhost:5000/checkpoints//x:1", False),
        ("user@evil.example/checkpoints/x:1", False),
        ("localhost:5000/checkpoints/x@sha256:short", False),
    ],
)
def test_the_registry_allow_list_matches_host_and_path_components(name: str, ok: bool) -> None:
    assert Policy.of([OURS]).allows_registry(name) is ok


def test_the_default_allow_list_is_the_configured_registry_and_says_how_to_widen_it() -> None:
    policy = Policy.from_env({}, OURS)
    assert policy.registries == (OURS,) and policy.namespaces is None
    with pytest.raises(Refused, match=r"'evil.example/x' is not in the allowed registries.*PODMIGRATE_ALLOWED_REG"):
        policy.check_registry("evil.example/x")
    both = Policy.from_env(
        {"PODMIGRATE_ALLOWED_REGISTRIES": "a.example/x, b.example", "PODMIGRATE_NAMESPACES": "web"}, OURS
    )
    assert both.allows_registry("b.example/y/z:1") and not both.allows_registry(OURS + "/x:1")
    with pytest.raises(Refused, match="namespace 'kube-system' is not served"):
        both.check_namespace("kube-system")


def test_a_reference_by_digest_keeps_the_repository_and_drops_the_tag() -> None:
    d = "sha256:" + "0" * 64
    assert by_digest("localhost:5000/checkpoints/web-server:2026", d) == f"localhost:5000/checkpoints/web-server@{d}"
    with pytest.raises(Refused, match="refusing to restore by tag"):
        by_digest("localhost:5000/checkpoints/web:1", "")


# ------------------------------------------------------------------------------ the operator's validate
class NoAgents(controller.Agents):
    """Agents that must not be reached: a refused migration freezes nothing."""

    def call(self, node: str, path: str, body: dict[str, Any], timeout: float = 900.0) -> Any:
        raise AssertionError(f"agent called: {node} {path}")

    def info(self, node: str) -> dict[str, Any]:
        raise AssertionError(f"agent asked: {node}")


@pytest.fixture(scope="module")
def kube() -> Any:
    api = FakeKubeAPI()
    ready = [{"type": "Ready", "status": "True"}]
    for node in ("node-a", "node-b"):
        info = {"nodeInfo": {"containerRuntimeVersion": "containerd://2.1.4"}, "conditions": ready}
        api.create(k.nodes(), {"metadata": {"name": node}, "status": info})
    for ns in ("default", "other"):
        api.create(k.pods(ns), {
            "metadata": {"name": "web", "namespace": ns, "labels": {"app": "web"}},
            "spec": {"nodeName": "node-a", "containers": [{"name": "server", "image": "heapsrv"}]},
            "status": {"phase": "Running", "conditions": ready},
        })  # fmt: skip
    return api


def migrate(api: k.KubeAPI, ns: str, name: str, spec: dict[str, Any], **config: Any) -> controller.Ctx:
    """A PodLiveMigration in the API, run by the operator's runner up to the end of validate."""
    api.create(k.migrations(ns), {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration",
                                  "metadata": {"name": name, "namespace": ns}, "spec": spec})  # fmt: skip
    cfg = controller.Config(registry=OURS, poll_s=0.01, **config)
    events: list[tuple[str, str, str]] = []
    ctx = controller.Ctx(api, NoAgents(api, cfg), cfg, ns, name, spec, K8sRecord(), lambda *e: events.append(e))
    controller.run(ctx, stop_after="validate")
    return ctx


def refused(api: k.KubeAPI, ctx: controller.Ctx, reason: str, message: str) -> None:
    st = (api.get(k.migrations(ctx.ns, ctx.name)) or {}).get("status") or {}
    assert st.get("phase") == "Failed" and st.get("reason") == reason, st
    assert message in st["message"], st["message"]
    pod = api.get(k.pods(ctx.ns, "web")) or {}
    assert LOCK not in (pod["metadata"].get("annotations") or {})  # not even locked: nothing started
    assert "references" not in ctx.rec


def test_a_foreign_registry_in_a_podlivemigration_is_refused_at_validation(kube: k.KubeAPI) -> None:
    spec = {"podName": "web", "targetNode": "node-b", "registry": "evil.example:5000/loot"}
    ctx = migrate(kube, "default", "exfiltrate", spec)
    refused(kube, ctx, "RegistryNotAllowed", "spec.registry 'evil.example:5000/loot' is not in the allowed registries")
    assert "PODMIGRATE_ALLOWED_REGISTRIES" in ctx.rec["error"]["message"]
    # a look-alike path under the allowed host is no better
    ctx = migrate(kube, "default", "lookalike", {**spec, "registry": "localhost:5000/checkpoints-x"})
    refused(kube, ctx, "RegistryNotAllowed", "'localhost:5000/checkpoints-x' is not in the allowed registries")


def test_an_allowed_registry_passes_validation(kube: k.KubeAPI) -> None:
    spec = {"podName": "web", "targetNode": "node-b", "registry": "registry.example:5000/ckpt"}
    ctx = migrate(kube, "default", "allowed", spec, allowed_registries=(OURS, "registry.example:5000/ckpt"))
    assert ctx.rec["done"] == ["validate"], ctx.rec.get("error")
    assert all(r.startswith("registry.example:5000/ckpt/default-web-server:") for r in ctx.rec["references"].values())
    controller.rollback(ctx)  # unlock the pod for the other tests
    assert LOCK not in ((kube.get(k.pods("default", "web")) or {})["metadata"].get("annotations") or {})


def test_a_lock_taken_between_validates_read_and_its_write_is_not_overwritten(kube: k.KubeAPI) -> None:
    """Another PodLiveMigration locks the pod after this one read it unlocked: the lock carries the
    resourceVersion read, the API answers 409, and this one fails naming the holder."""
    kube.create(k.migrations("default"), {"metadata": {"name": "first", "namespace": "default"},
                                          "status": {"phase": "Checkpointing"}})  # fmt: skip
    pod = k.pods("default", "web")

    def steal(path: str) -> None:
        if path == pod:
            kube.before_patch = None  # type: ignore[attr-defined]
            kube.patch(pod, {"metadata": {"annotations": {LOCK: "first"}}})

    kube.before_patch = steal  # type: ignore[attr-defined]
    try:
        ctx = migrate(kube, "default", "second", {"podName": "web", "targetNode": "node-b"})
        st = (kube.get(k.migrations("default", "second")) or {}).get("status") or {}
        assert st.get("phase") == "Failed", st
        assert "already being migrated by PodLiveMigration 'first'" in st["message"], st["message"]
        assert (kube.get(pod) or {})["metadata"]["annotations"][LOCK] == "first"  # not overwritten
        assert "references" in ctx.rec and ctx.rec["done"] == []
    finally:
        kube.patch(pod, {"metadata": {"annotations": {LOCK: None}}})
        kube.delete(k.migrations("default", "first"))


def test_a_409_for_another_change_of_the_pod_is_retried_on_the_pod_as_it_is(kube: k.KubeAPI) -> None:
    pod = k.pods("default", "web")

    def kubelet_writes(path: str) -> None:
        if path == pod:
            kube.before_patch = None  # type: ignore[attr-defined]
            kube.patch(pod, {"metadata": {"labels": {"touched": "yes"}}})

    kube.before_patch = kubelet_writes  # type: ignore[attr-defined]
    ctx = migrate(kube, "default", "retried", {"podName": "web", "targetNode": "node-b"})
    assert ctx.rec["done"] == ["validate"], ctx.rec.get("error")
    assert (kube.get(pod) or {})["metadata"]["annotations"][LOCK] == "retried"
    controller.rollback(ctx)
    kube.patch(pod, {"metadata": {"labels": {"touched": None}}})


class RuntimeClassAgents(NoAgents):
    """Agents whose target serves the podmigrate RuntimeClass (asked at validate, nothing else)."""

    def info(self, node: str) -> dict[str, Any]:
        return {"restore_handler": "podmigrate-runc"}


def test_the_runtimeclass_path_seals_only_with_the_operators_key_and_says_so_when_it_cannot(
    kube: k.KubeAPI,
) -> None:
    rc = "/apis/node.k8s.io/v1/runtimeclasses"
    kube.create(rc, {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": "podmigrate"}, "handler": "podmigrate-runc"})  # fmt: skip
    spec = {"podName": "web", "targetNode": "node-b", "restorePath": "runtimeclass"}
    try:
        for name, master in (("unsealed", ""), ("sealed", seal.new_key())):
            cfg = controller.Config(registry=OURS, poll_s=0.01, seal_master=master)
            resource = {"apiVersion": "podmigrate.io/v1alpha1", "kind": "PodLiveMigration",
                        "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip
            kube.create(k.migrations("default"), resource)
            events: list[tuple[str, ...]] = []
            agents = RuntimeClassAgents(kube, cfg)
            ctx = controller.Ctx(
                kube, agents, cfg, "default", name, spec, K8sRecord(), lambda *e, ev=events: ev.append(e)
            )
            controller.run(ctx, stop_after="validate")
            assert ctx.rec["restore_path"] == "runtimeclass", ctx.rec.get("error")
            assert ctx.rec["sealed"] is bool(master)
            unsealed = [e for e in events if e[1] == "Unsealed"]
            assert bool(unsealed) is not bool(master), events
            if master:  # an operator restarted without its key cannot open what it sealed, and says why
                ctx.config = controller.Config(registry=OURS, poll_s=0.01)
                with pytest.raises(PodmigrateError, match="this operator has no seal key to open them"):
                    phases.seal(ctx)
            controller.rollback(ctx)
    finally:
        kube.delete(f"{rc}/podmigrate")


def test_a_namespace_the_operator_does_not_serve_is_refused(kube: k.KubeAPI) -> None:
    ctx = migrate(kube, "other", "elsewhere", {"podName": "web", "targetNode": "node-b"}, namespaces=("default",))
    refused(kube, ctx, "NamespaceNotServed", "namespace 'other' is not served")


def test_a_podlivemigration_cannot_name_a_pod_of_another_namespace(kube: k.KubeAPI) -> None:
    ctx = migrate(kube, "default", "reach", {"podName": "other/web", "targetNode": "node-b"})
    refused(kube, ctx, "InvalidSpec", "spec.podName")


# ------------------------------------------------------------------------------ the node agent
class FakeKubelet(BaseHTTPRequestHandler):
    """The Checkpoint API as the kubelet answers it: writes an archive where the kubelet would."""

    directory: Path
    token: str
    calls: list[str]
    together: threading.Barrier | None = None  # set: a checkpoint answers only while the others run

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.calls.append(self.path)
        ok = self.headers.get("Authorization") == f"Bearer {self.token}"
        if ok and self.together is not None:
            try:
                self.together.wait(10)
            except threading.BrokenBarrierError:
                ok = False
        _, _, ns, pod, container = self.path.split("?")[0].split("/")
        out = self.directory / f"checkpoint-{pod}_{ns}-{container}-1.tar"
        if ok:
            out.write_bytes(checkpoint_archive(os.urandom(4096)))
        body = json.dumps({"items": [str(out)]} if ok else {}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def checkpoint_archive(pages: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in (("checkpoint/descriptors.json", b"[]"), ("checkpoint/pages-1.img", pages)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("k8s-reg")
    port = free_port()
    (tmp / "config.yml").write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {tmp / 'data'}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
    )
    proc = subprocess.Popen(["docker-registry", "serve", str(tmp / "config.yml")], stderr=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]).returncode == 0, 30, "reg"
        )
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


class Agent:
    def __init__(self, tmp: Path, reg: str):
        self.ca = CA(tmp / "pki", "test")
        self.checkpoints, self.restores = tmp / "checkpoints", tmp / "restore"
        self.checkpoints.mkdir()
        kubelet_id = self.ca.issue("kubelet", ips=["127.0.0.1"])
        self.kubelet_calls: list[str] = []
        handler = type("K", (FakeKubelet,), {"directory": self.checkpoints, "token": "kt", "calls": self.kubelet_calls})
        self.kubelet = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        kctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        kctx.load_cert_chain(kubelet_id.cert, kubelet_id.key)
        self.kubelet.socket = kctx.wrap_socket(self.kubelet.socket, server_side=True)
        kubelet = KubeletClient(f"https://127.0.0.1:{self.kubelet.server_address[1]}", "kt", ca=str(self.ca.cert_path))
        self.allowed = f"{reg}/checkpoints"
        app = node_agent.build_app(
            "node-a", "", kubelet, self.checkpoints, Restores(self.restores, self.restores),
            policy=Policy.of([self.allowed], ["default"]), peers=["podmigrate-operator"],
        )  # fmt: skip
        me = self.ca.issue("node-a", ips=["127.0.0.1"])
        tls = node_agent.server_context(str(me.cert), str(me.key), client_ca=str(self.ca.cert_path))
        self.server = node_agent.serve(app, "127.0.0.1:0", tls)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.operator = self.ca.issue("podmigrate-operator")
        for s in (self.kubelet, self.server):
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def client(self, tls: ssl.SSLContext | None = None, token: str = "") -> AgentClient:
        return AgentClient("node-a", None, token, 30.0, base_url=self.url, tls=tls or self.operator.client_context())

    def close(self) -> None:
        for s in (self.server, self.kubelet):
            s.shutdown()
            s.server_close()


@pytest.fixture
def agent(tmp_path: Path, reg: str) -> Iterator[Agent]:
    a = Agent(tmp_path, reg)
    yield a
    a.close()


def test_the_agent_over_tls_answers_only_the_operators_certificate(agent: Agent, tmp_path: Path) -> None:
    assert agent.client().get("/v1/info")["name"] == "node-a"
    # no client certificate (a token does not help: there is none to guess, and TLS ends first)
    bare = ssl.create_default_context(cafile=str(agent.ca.cert_path))
    with pytest.raises(AgentError, match="unreachable"):
        agent.client(bare, token="guess").get("/v1/info")
    # a certificate of another CA, with the operator's name
    forged = CA(tmp_path / "evil", "evil").issue("podmigrate-operator")
    ctx = ssl.create_default_context(cafile=str(agent.ca.cert_path))
    ctx.load_cert_chain(forged.cert, forged.key)
    with pytest.raises(AgentError, match="unreachable"):
        agent.client(ctx).get("/v1/info")
    # plain HTTP to the https port
    plain = AgentClient("node-a", None, "guess", 5.0, base_url=agent.url.replace("https", "http"))
    with pytest.raises(AgentError):
        plain.get("/v1/info")
    # a certificate of the right CA that is not the operator's (another node's agent)
    with pytest.raises(PodmigrateError, match="certificate 'node-b' is not one of its peers"):
        agent.client(agent.ca.issue("node-b").client_context()).get("/v1/info")


def test_the_agent_refuses_pods_outside_its_namespaces_and_pushes_outside_its_registries(agent: Agent) -> None:
    c = agent.client()
    body = {"namespace": "kube-system", "pod": "etcd", "containers": ["etcd"], "checkpoint_id": "c1"}
    with pytest.raises(PodmigrateError, match="namespace 'kube-system' is not served"):
        c.post("/v1/checkpoints", body)
    assert agent.kubelet_calls == []  # refused before the kubelet was asked to freeze anything
    archives = c.post("/v1/checkpoints", {**body, "namespace": "default", "pod": "web", "containers": ["server"]})
    path = archives["archives"]["server"]["path"]
    assert agent.kubelet_calls and Path(path).exists()
    for foreign in ("evil.example:5000/loot/web:c1", agent.allowed + "-evil/web:c1"):
        push = {"namespace": "default", "pod": "web", "checkpoint_id": "c1",
                "archives": {"server": path}, "references": {"server": foreign}}  # fmt: skip
        with pytest.raises(PodmigrateError, match="is not in the allowed registries"):
            c.post("/v1/images", push)
        with pytest.raises(PodmigrateError, match="is not in the allowed registries"):
            c.post("/v1/images/delete", {"references": [foreign]})
    assert Path(path).exists()  # nothing was sent anywhere, the archive waits for an allowed push
    mistagged = {**push, "references": {"server": f"{agent.allowed}/web:another-migration"}}
    with pytest.raises(PodmigrateError, match="not tagged with its migration's id c1"):
        c.post("/v1/images", mistagged)


def test_the_agent_checkpoints_a_pods_containers_at_once(agent: Agent) -> None:
    """Each kubelet checkpoint freezes its container for seconds: one after the other, the pod's
    blackout would be their sum (the fake kubelet answers only once both are asked)."""
    agent.kubelet.RequestHandlerClass.together = threading.Barrier(2)  # type: ignore[attr-defined]
    body = {"namespace": "default", "pod": "web", "containers": ["server", "sidecar"], "checkpoint_id": "c9"}
    got = agent.client().post("/v1/checkpoints", body)["archives"]
    assert sorted(got) == ["server", "sidecar"] and all(Path(a["path"]).exists() for a in got.values())
    assert sorted(c.split("?")[0].rsplit("/", 1)[1] for c in agent.kubelet_calls) == ["server", "sidecar"]


def checkpointed(c: AgentClient, allowed: str, cid: str) -> dict[str, Any]:
    """A push request for a fresh checkpoint of default/web (kubelet stub) as migration ``cid``."""
    body = {"namespace": "default", "pod": "web", "containers": ["server"], "checkpoint_id": cid}
    path = c.post("/v1/checkpoints", body)["archives"]["server"]["path"]
    return {**body, "archives": {"server": path}, "references": {"server": f"{allowed}/default-web-server:{cid}"}}


def test_a_restore_goes_by_the_pushed_digest_and_never_to_a_foreign_registry(agent: Agent, tmp_path: Path) -> None:
    c = agent.client()
    push = checkpointed(c, agent.allowed, "c2")
    ref = push["references"]["server"]
    pushed = c.post("/v1/images", push)["images"]["server"]
    # someone moves the tag to another image after the push
    other = tmp_path / "other.tar"
    other.write_bytes(checkpoint_archive(b"not the process"))
    moved = registry.push_checkpoint(other, ref, registry.checkpoint_annotations("server"))
    assert moved["manifest_digest"] != pushed["manifest_digest"]
    images = {"server": {"reference": ref, "digest": pushed["manifest_digest"]}}
    got = c.post("/v1/restores", {"checkpoint_id": "c2", "namespace": "default", "images": images})
    verified = json.loads((agent.restores / "c2/server/podmigrate-verified.json").read_text())
    assert got["restores"]["server"]["path"] == str(agent.restores / "c2/server")
    assert verified["reference"] == by_digest(ref, pushed["manifest_digest"])
    assert verified["layer_digest"] == pushed["layer_digest"] != moved["layer_digest"]  # the source's, not the tag's
    wanted = {"server": {"reference": ref, "digest": "sha256:" + "1" * 64}}
    with pytest.raises(PodmigrateError, match="not the checkpoint image that was pushed"):
        c.post("/v1/restores", {"checkpoint_id": "c3", "namespace": "default", "images": wanted})
    foreign = {"server": {"reference": "evil.example/ckpt/web:c2", "digest": pushed["manifest_digest"]}}
    with pytest.raises(PodmigrateError, match=r"restore from 'evil\.example/ckpt/web:c2' is not in the allowed"):
        c.post("/v1/restores", {"checkpoint_id": "c4", "namespace": "default", "images": foreign})
    assert not (agent.restores / "c4").exists()


def test_a_sealed_image_is_ciphertext_in_the_registry_and_restores_only_with_its_migrations_key(
    agent: Agent,
) -> None:
    c = agent.client()
    config = controller.Config(seal_master=seal.new_key())
    key = config.seal_key("c5")
    assert key and key == controller.Config(seal_master=config.seal_master).seal_key("c5") != config.seal_key("c6")
    body = {"namespace": "default", "pod": "web", "containers": ["server"], "checkpoint_id": "c5"}
    path = c.post("/v1/checkpoints", body)["archives"]["server"]["path"]
    ref = f"{agent.allowed}/default-web-server:c5"
    pushed = c.post("/v1/images", {**body, "archives": {"server": path}, "references": {"server": ref}, "seal": key})
    digest = pushed["images"]["server"]["manifest_digest"]
    host, repo, _ = registry.split_reference(ref)
    manifest, _ = registry.Registry(host, repo=repo).get_manifest(repo, digest)
    assert manifest["layers"][0]["mediaType"].endswith("+podmigrate-sealed")
    images = {"server": {"reference": ref, "digest": digest}}
    for extra, why in (
        ({}, "sealed for a migration, and this restore has no key"),
        ({"seal": config.seal_key("c6")}, "not sealed for this migration"),  # another migration's key
    ):
        with pytest.raises(PodmigrateError, match=why):
            c.post("/v1/restores", {"checkpoint_id": "c5", "namespace": "default", "images": images, **extra})
        assert not (agent.restores / "c5" / "server").exists()
    got = c.post("/v1/restores", {"checkpoint_id": "c5", "namespace": "default", "images": images, "seal": key})
    assert (Path(got["restores"]["server"]["path"]) / "podmigrate-verified.json").exists()


def test_the_cri_restore_runs_the_checkpoint_image_by_digest_and_never_by_tag() -> None:
    from podmigrate.k8s.phases import _copy

    d = "sha256:" + "2" * 64
    src = {"metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
           "spec": {"containers": [{"name": "server", "image": "heapsrv"}]}}  # fmt: skip
    rec = K8sRecord(images={"server": f"{OURS}/default-web-server:c5"}, digests={"server": d}, source_pod=src,
                    restored="web-mabcdef", target="node-b", restore_path="cri")  # fmt: skip
    cfg = controller.Config()
    ctx = controller.Ctx(None, NoAgents(None, cfg), cfg, "default", "m", {}, rec, lambda *e: None)  # type: ignore[arg-type]
    pod = _copy(ctx)
    assert pod["spec"]["containers"][0]["image"] == f"{OURS}/default-web-server@{d}"
    del rec["digests"]
    with pytest.raises(PodmigrateError, match="refusing to restore by tag"):
        _copy(ctx)


def test_the_operator_finds_and_calls_the_agent_over_mutual_tls(
    kube: k.KubeAPI, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the Kubernetes lab wires: the operator's environment -> Config -> Agents -> https."""
    from podmigrate.k8s import operator

    port = agent.server.server_address[1]
    kube.create(k.pods("podmigrate-system"), {
        "metadata": {"name": "podmigrate-agent-node-a", "namespace": "podmigrate-system",
                     "labels": {"app.kubernetes.io/name": "podmigrate-agent"}},
        "spec": {"nodeName": "node-a",
                 "containers": [{"name": "agent", "ports": [{"name": "agent", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    })  # fmt: skip
    env = {"PODMIGRATE_AGENT_CA": str(agent.ca.cert_path), "PODMIGRATE_AGENT_CERT": str(agent.operator.cert),
           "PODMIGRATE_AGENT_KEY": str(agent.operator.key), "PODMIGRATE_AGENT_TOKEN": "",
           "PODMIGRATE_ALLOWED_REGISTRIES": f"{OURS}, registry.example/ckpt",
           "PODMIGRATE_NAMESPACES": "default"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = operator.config()
    assert cfg.policy() == Policy.of([OURS, "registry.example/ckpt"], ["default"])
    agents = controller.Agents(kube, cfg)
    try:
        assert agents.url("node-a") == f"https://127.0.0.1:{port}"
        assert agents.info("node-a")["name"] == "node-a"
    finally:
        agents.close()
    no_cert = controller.Agents(kube, controller.Config(agent_ca=str(agent.ca.cert_path)))
    try:
        with pytest.raises(AgentError, match="unreachable"):
            no_cert.info("node-a")
    finally:
        no_cert.close()
    kube.delete(k.pods("podmigrate-system", "podmigrate-agent-node-a"))


def test_a_push_names_its_migration_and_a_repeat_does_not_follow_a_moved_tag(agent: Agent, tmp_path: Path) -> None:
    c = agent.client()
    push = checkpointed(c, agent.allowed, "c7")
    ref = push["references"]["server"]
    for missing in ("namespace", "checkpoint_id"):
        with pytest.raises(PodmigrateError, match="a push names its namespace and checkpoint_id"):
            c.post("/v1/images", {k: v for k, v in push.items() if k != missing})
    first = c.post("/v1/images", push)["images"]["server"]
    assert c.post("/v1/images", push)["images"]["server"]["manifest_digest"] == first["manifest_digest"]  # a retry
    other = tmp_path / "other.tar"
    other.write_bytes(checkpoint_archive(b"not the process"))
    registry.push_checkpoint(other, ref, registry.checkpoint_annotations("server"))  # the tag moves
    with pytest.raises(PodmigrateError, match="is no longer the image migration c7 pushed"):
        c.post("/v1/images", push)
    with pytest.raises(PodmigrateError, match="a restore names the namespace of its migration"):
        c.post(
            "/v1/restores",
            {"checkpoint_id": "c7", "images": {"server": {"reference": ref, "digest": first["manifest_digest"]}}},
        )
