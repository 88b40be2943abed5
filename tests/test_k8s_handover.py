"""A streamed or decoupled migration's Service handover without a cluster: the operator's
EndpointSlices on the in-memory fake API (``tests/fake_kube.py``; on upstream Kubernetes:
``tests/test_kube_stream.py``), and the agent's serving check against real servers on loopback."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.k8s import api as k
from podmigrate.k8s import handover, phases, serving
from podmigrate.k8s.agents import Config
from podmigrate.k8s.context import INSTANCE, Ctx, K8sRecord

from .fake_kube import FakeKubeAPI

NS = "default"
PORTS = [{"name": "http", "port": 8000, "protocol": "TCP"}, {"name": "dns", "port": 53, "protocol": "UDP"}]


def endpoint(pod: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod}}


def controller_slice(api: FakeKubeAPI, *endpoints: dict[str, Any]) -> None:
    """The EndpointSlice controller's slice of Service ``web`` (written over on each call)."""
    api.objects[handover.slices(NS, "web-abcde")] = {
        "metadata": {"name": "web-abcde", "labels": {handover.SERVICE: "web",
                     "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4", "ports": PORTS, "endpoints": list(endpoints),
    }  # fmt: skip


@pytest.fixture
def ctx() -> Ctx:
    api = FakeKubeAPI()
    api.objects[k.services(NS, "web")] = {"metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}}}
    api.objects[k.migrations(NS, "m1")] = {"apiVersion": "podmigrate.io/v1alpha1", "metadata": {"uid": "u-1"}}
    api.objects[k.pods(NS, "web-copy")] = {"metadata": {"name": "web-copy", "uid": "u-copy"}}
    controller_slice(api, endpoint("web-src", "10.0.0.2"))
    rec = K8sRecord(id="m1-id", services={"web": {"app": "web"}}, restored="web-copy", target="node-b")
    cfg = Config(poll_s=0.01)
    return Ctx(api, None, cfg, NS, "m1", {"podName": "web-src"}, rec, lambda *e: None)  # type: ignore[arg-type]


def ours(ctx: Ctx) -> list[dict[str, Any]]:
    return ctx.api.list(handover.slices(NS), label_selector=handover.OURS)


def test_the_source_moves_into_the_operators_slice_before_the_selector_leaves_it(ctx: Ctx) -> None:
    seen: list[tuple[str, int]] = []  # what a proxy serves at each write: never nothing
    api: FakeKubeAPI = ctx.api  # type: ignore[assignment]
    api.before_patch = lambda path: seen.append((path, len(ours(ctx))))
    handover.take(ctx)
    (mine,) = ours(ctx)
    assert mine["endpoints"] == [endpoint("web-src", "10.0.0.2")] and mine["ports"] == PORTS
    assert mine["metadata"]["labels"][handover.MIGRATION] == "m1-id"
    assert mine["metadata"]["ownerReferences"][0]["uid"] == "u-1"  # deleting the migration deletes it
    # the selector moved after the slice existed (the record saved between)
    assert [s for s in seen if "services" in s[0]] == [(k.services(NS, "web"), 1)]
    svc = ctx.api.get(k.services(NS, "web")) or {}
    assert svc["spec"]["selector"] == {"app": "web", INSTANCE: "handed-over-m1-id"}
    handover.take(ctx)  # resumed: nothing made twice
    assert len(ours(ctx)) == 1


def test_the_cutover_is_one_write_and_the_slice_goes_once_the_controller_lists_the_copy(ctx: Ctx) -> None:
    handover.take(ctx)
    handover.switch(ctx, "10.0.1.7")
    (mine,) = ours(ctx)
    (ep,) = mine["endpoints"]
    assert ep["addresses"] == ["10.0.1.7"] and ep["conditions"]["ready"] and ep["nodeName"] == "node-b"
    assert ep["targetRef"] == {"kind": "Pod", "namespace": NS, "name": "web-copy", "uid": "u-copy"}
    controller_slice(ctx.api, endpoint("web-copy", "10.0.1.7"))  # type: ignore[arg-type]
    # the selectors come back only once the kubelet says the copy is Ready: listed not ready by the
    # controller beside the operator's ready entry, kube-proxy may keep the not-ready one
    api: FakeKubeAPI = ctx.api  # type: ignore[assignment]
    copy = api.objects[k.pods(NS, "web-copy")]
    ready_when_given_back: list[bool] = []

    def given_back(path: str) -> None:
        if path == k.services(NS, "web"):
            ready_when_given_back.append(k.pod_ready(copy))

    api.before_patch = given_back
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    threading.Timer(0.3, lambda: copy.update(status=ready)).start()
    assert handover.release(ctx, "web-copy", 5.0) is None
    assert ready_when_given_back == [True]
    assert ours(ctx) == [] and (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"] == {"app": "web"}


def test_a_copy_the_controller_never_lists_is_said_and_its_slice_deleted_all_the_same(ctx: Ctx) -> None:
    handover.take(ctx)
    handover.switch(ctx, "10.0.1.7")
    controller_slice(ctx.api, endpoint("web-copy", "10.0.1.7", ready=False))  # type: ignore[arg-type]
    warning = handover.release(ctx, "web-copy", 0.2)
    assert warning and "do not list web-copy as ready" in warning
    assert ours(ctx) == []


def test_a_switch_without_the_copys_address_is_refused(ctx: Ctx) -> None:
    handover.take(ctx)
    with pytest.raises(Exception, match="address of web-copy is not known"):
        handover.switch(ctx, "")
    assert ours(ctx)[0]["endpoints"][0]["addresses"] == ["10.0.0.2"]  # the source still listed


def test_the_checks_are_the_copys_readiness_probes_and_its_services_tcp_ports() -> None:
    pod = {"spec": {"containers": [
        {"name": "server"},  # no probe: its Services' port says whether it serves
        {"name": "sidecar", "ports": [{"name": "http", "containerPort": 8000}],
         "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}}},
        {"name": "db", "readinessProbe": {"tcpSocket": {"port": 5432}}},
    ]}}  # fmt: skip
    assert handover._checks(pod, [PORTS]) == [
        {"port": 8000, "path": "/healthz", "scheme": "HTTP", "headers": []},
        {"port": 5432},
        {"port": 8000},  # UDP 53 is not connected to
    ]
    pod["spec"]["containers"].append({"name": "x", "readinessProbe": {"exec": {"command": ["true"]}}})
    assert handover._checks(pod, [PORTS]) is None  # only the kubelet can run that one


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def web() -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def test_the_agent_says_serving_only_once_every_check_passes(web: int) -> None:
    ok = serving.wait({"address": "127.0.0.1", "checks": [{"port": web, "path": "/healthz"}, {"port": web}]})
    assert ok["serving"] and ok["seconds"] >= 0
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    no = serving.wait({"address": "127.0.0.1", "checks": [{"port": web}, {"port": closed}], "timeout": 0.1})
    assert not no["serving"] and f"port {closed}" in no["why"]
    bad = serving.wait({"address": "127.0.0.1", "checks": [{"port": web, "path": "/other"}], "timeout": 0.1})
    assert not bad["serving"] and "HTTP 503" in bad["why"]
    with pytest.raises(Exception, match="not a pod address"):
        serving.wait({"address": "web; rm -rf /", "checks": [{"port": web}]})


class FakeAgents:
    """The node agents (named fake): each call, with what a proxy served when it came."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.calls: list[tuple[str, list[Any], dict[str, Any]]] = []

    def call(self, node: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        svc = self.ctx.api.get(k.services(NS, "web")) or {}
        self.calls.append((path, [s["endpoints"] for s in ours(self.ctx)], svc["spec"]["selector"]))
        if path == "/v1/checkpoints":
            return {"archives": {"server": {"path": "/var/lib/kubelet/checkpoints/x.tar"}}}
        return {"deleted": {"/var/lib/kubelet/checkpoints/x.tar": True}}


@pytest.fixture
def decoupled(ctx: Ctx) -> Ctx:
    ctx.spec.update(mode="decoupled", timeouts={"checkpointSeconds": 60, "restoreSeconds": 60})
    ctx.rec["containers"], ctx.rec["source"] = ["server"], "node-a"
    ctx.agents = FakeAgents(ctx)  # type: ignore[assignment]
    return ctx


def test_a_decoupled_source_stays_served_while_the_kubelets_checkpoint_fails_its_readiness(decoupled: Ctx) -> None:
    ctx, agents = decoupled, decoupled.agents
    phases.checkpoint(ctx)
    # the operator's slice held the source before the kubelet froze it
    (call,) = agents.calls  # type: ignore[attr-defined]
    assert call[0] == "/v1/checkpoints" and call[1] == [[endpoint("web-src", "10.0.0.2")]]
    assert call[2][INSTANCE] == "handed-over-m1-id"
    controller_slice(ctx.api, endpoint("web-src", "10.0.0.2", ready=False))  # type: ignore[arg-type]
    (mine,) = ours(ctx)  # its probe failed while frozen: the controller's slice says so, ours serves it on
    assert mine["endpoints"] == [endpoint("web-src", "10.0.0.2")]
    ctx.rec["pod_ip"] = "10.0.1.7"
    phases.cutover(ctx)  # one write, to the copy's address
    (mine,) = ours(ctx)
    assert [e["addresses"] for e in mine["endpoints"]] == [["10.0.1.7"]]
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"][INSTANCE] == "handed-over-m1-id"


def test_a_decoupled_checkpoint_undone_gives_the_services_back_and_deletes_the_archives(decoupled: Ctx) -> None:
    ctx = decoupled
    phases.checkpoint(ctx)
    said = phases.undo_checkpoint(ctx)
    assert said == "deleted archives ['/var/lib/kubelet/checkpoints/x.tar']; Services given back"
    assert ours(ctx) == []
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"] == {"app": "web"}


def test_a_service_deleted_before_the_switch_is_refused_and_released_without_waiting(ctx: Ctx) -> None:
    handover.take(ctx)
    del ctx.api.objects[k.services(NS, "web")]  # type: ignore[attr-defined]
    with pytest.raises(PodmigrateError, match=r"Services \['web'\] were deleted during the migration"):
        handover.switch(ctx, "10.0.1.7")
    # asked after the switch (off the blackout): the cutover's undo lists the source again
    assert phases.undo_cutover(ctx) == "the Services' slices list web-src again"
    (mine,) = ours(ctx)
    assert [e["addresses"] for e in mine["endpoints"]] == [["10.0.0.2"]]
    # the rollback: no controller will list the source for a Service that is gone; nothing waits for it
    controller_slice(ctx.api, endpoint("web-src", "10.0.0.2", ready=False))  # type: ignore[arg-type]
    assert handover.release(ctx, "web-src", 60.0) is None
    assert ours(ctx) == []


def test_a_cutover_undone_lists_the_source_again_and_the_copy_never_joins(decoupled: Ctx) -> None:
    ctx = decoupled
    phases.checkpoint(ctx)
    ctx.rec["pod_ip"] = "10.0.1.7"
    phases.cutover(ctx)
    assert phases.undo_cutover(ctx) == "the Services' slices list web-src again"
    (mine,) = ours(ctx)
    assert mine["endpoints"] == [endpoint("web-src", "10.0.0.2")]
    # the selector stays handed over: the copy, carrying the source's labels, is in no controller's slice
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"][INSTANCE] == "handed-over-m1-id"


def test_a_service_that_does_not_list_the_source_is_not_handed_over(ctx: Ctx) -> None:
    controller_slice(ctx.api, endpoint("other-pod", "10.0.0.9"))  # type: ignore[arg-type]
    with pytest.raises(PodmigrateError, match=r"Services \['web'\] do not list web-src as an endpoint"):
        handover.take(ctx)
    assert ours(ctx) == []  # nothing made, and the selector untouched
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"] == {"app": "web"}


@pytest.fixture
def stop_copy(ctx: Ctx) -> Ctx:
    """A stop-copy migration whose Service controller empties its slice when the selector leaves the
    source (as the EndpointSlice controller does), with no kube-proxy to wait for."""
    ctx.spec.update(mode="stop-copy", timeouts={"checkpointSeconds": 60, "restoreSeconds": 60})
    ctx.config = Config(poll_s=0.01, drain_s=0.0, blackout_poll_s=0.01)
    api: FakeKubeAPI = ctx.api  # type: ignore[assignment]
    api.before_patch = lambda path: controller_slice(api) if path == k.services(NS, "web") else None
    return ctx


def test_a_stop_copy_isolation_empties_the_operators_slice_and_the_cutover_lists_the_copy(stop_copy: Ctx) -> None:
    ctx = stop_copy
    phases.isolate(ctx)
    (mine,) = ours(ctx)
    assert mine["endpoints"] == []  # nothing reaches the source from here on
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"][INSTANCE] == "handed-over-m1-id"
    assert "isolated_at" in ctx.rec
    ctx.rec["pod_ip"] = "10.0.1.7"
    phases.cutover(ctx)  # one write, as soon as the copy serves: no wait for its Ready
    (mine,) = ours(ctx)
    assert [e["addresses"] for e in mine["endpoints"]] == [["10.0.1.7"]]


def test_a_stop_copy_rolled_back_after_its_cutover_gives_the_source_its_services_back(stop_copy: Ctx) -> None:
    ctx = stop_copy
    phases.isolate(ctx)
    ctx.rec["pod_ip"] = "10.0.1.7"
    phases.cutover(ctx)
    assert phases.undo_cutover(ctx) == "the Services' slices list web-src again"  # the runner's order
    api: FakeKubeAPI = ctx.api  # type: ignore[assignment]
    api.before_patch = lambda path: controller_slice(api, endpoint("web-src", "10.0.0.2"))
    assert phases.undo_isolate(ctx) == "Services given back"
    assert ours(ctx) == []  # gone once the controller's slice lists the source again
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"] == {"app": "web"}


def test_a_cold_isolation_moves_the_selector_and_makes_no_slice(stop_copy: Ctx) -> None:
    ctx = stop_copy
    ctx.spec["mode"] = "cold"
    phases.isolate(ctx)
    assert ours(ctx) == []
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"][INSTANCE] == "isolated-m1-id"
    assert phases.undo_isolate(ctx) == "restored the selectors of ['web']"
    assert (ctx.api.get(k.services(NS, "web")) or {})["spec"]["selector"] == {"app": "web"}


def test_an_agent_that_cannot_check_the_copy_leaves_the_cutover_to_the_kubelets_ready(ctx: Ctx) -> None:
    """One of an older podmigrate (no /v1/serving): asked once, said in an Event, then Ready decides."""
    asked: list[str] = []
    events: list[str] = []

    def refuse(node: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        asked.append(path)
        raise UsageError(f"agent {node} has no POST {path}")

    ctx.agents = SimpleNamespace(call=refuse)  # type: ignore[assignment]
    ctx.event = lambda kind, reason, msg: events.append(reason)
    ctx.spec["timeouts"] = {"restoreSeconds": 10}
    ctx.rec["containers"], ctx.rec["handover_ports"] = ["server"], [PORTS]
    copy = ctx.api.objects[k.pods(NS, "web-copy")]  # type: ignore[attr-defined]
    copy.update(spec={"containers": [{"name": "server"}]}, status={"phase": "Running", "podIP": "10.0.1.7"})
    ready = {"type": "Ready", "status": "True"}
    threading.Timer(0.3, lambda: copy["status"].update(conditions=[ready])).start()
    handover.wait_serving(ctx)
    assert ctx.rec["pod_ip"] == "10.0.1.7" and "serving_s" not in ctx.rec
    assert asked == ["/v1/serving"] and events == ["NoServingCheck"]


def test_a_streamed_copy_is_asked_of_its_agent_before_any_read_of_its_pod(ctx: Ctx) -> None:
    """The sandbox said the copy's address and its uid is known from its creation: the agent runs
    the source's probes there at once, and the pod is never read inside the blackout."""
    asked: list[dict[str, Any]] = []
    api: FakeKubeAPI = ctx.api  # type: ignore[assignment]
    reads: list[str] = []
    real_get = api.get

    def get(path: str) -> dict[str, Any] | None:
        reads.append(path)
        return real_get(path)

    api.get = get  # type: ignore[method-assign]

    def serving(node: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        asked.append({"node": node, "path": path, **body})
        return {"serving": True, "seconds": 0.01}

    ctx.agents = SimpleNamespace(call=serving)  # type: ignore[assignment]
    probe = {"httpGet": {"port": "http", "path": "/healthz"}}
    server = {"name": "server", "ports": [{"name": "http", "containerPort": 8000}], "readinessProbe": probe}
    ctx.rec["containers"], ctx.rec["handover_ports"], ctx.rec["copy_uid"] = ["server"], [PORTS], "u-copy"
    ctx.rec["source_pod"] = {"metadata": {"name": "web-src"}, "spec": {"containers": [server]}}
    ctx.rec["stream_ports"] = {"server": {"pod_ip": "10.0.1.7"}}
    handover.wait_serving(ctx)
    assert ctx.rec["pod_ip"] == "10.0.1.7" and "serving_s" in ctx.rec
    assert reads == []
    (ask,) = asked
    assert ask["node"] == "node-b" and ask["address"] == "10.0.1.7"
    assert ask["checks"] == [
        {"port": 8000, "path": "/healthz", "scheme": "HTTP", "headers": []},
        {"port": 8000},
    ]
