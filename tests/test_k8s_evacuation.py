"""NodeEvacuation without a cluster: its spec, the signs that start one, what it counts and plans
(an in-memory API stands in for the server; the cluster's tests are in test_kube_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest

from podmigrate.k8s import evacuation as ev
from podmigrate.k8s.agents import Config
from podmigrate.k8s.crd import SpecError
from podmigrate.k8s.evacuator import Evacuator, pod_memory, quantity


class MemoryAPI:
    """Objects by path; list by prefix (what the evacuator's survey and targets read)."""

    def __init__(self, objs: dict[str, dict[str, Any]]):
        self.objs = objs

    def get(self, path: str) -> dict[str, Any] | None:
        return self.objs.get(path)

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list[Any]:
        if path == "/api/v1/pods":
            return [o for p, o in self.objs.items() if "/pods/" in p]
        return [o for p, o in self.objs.items() if p.startswith(path + "/") and p.count("/") == path.count("/") + 1]

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.objs.setdefault(path, {})


def pod(name: str, node: str, memory: str | None, **meta: Any) -> dict[str, Any]:
    res = {"requests": {"memory": memory}} if memory else {}
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return {"metadata": {"name": name, "namespace": "default", **meta},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": res}]}, "status": status}  # fmt: skip


def node(name: str, memory: str = "8Gi", **spec: Any) -> dict[str, Any]:
    ready = [{"type": "Ready", "status": "True"}]
    return {
        "metadata": {"name": name},
        "spec": spec,
        "status": {"allocatable": {"memory": memory}, "conditions": ready},
    }


class NoAgents:
    def info(self, node: str) -> dict[str, Any]:
        return {"disk_free_bytes": 50 << 30}

    def close(self) -> None:
        pass


def evacuator(objs: dict[str, dict[str, Any]], spec: dict[str, Any]) -> Evacuator:
    e = Evacuator(MemoryAPI(objs), "nev", Config())  # type: ignore[arg-type]
    e.agents = NoAgents()  # type: ignore[assignment]
    e.spec = spec
    return e


def test_quantities_and_a_pods_memory() -> None:
    assert quantity("300Mi") == 300 << 20 and quantity("1G") == 10**9 and quantity("1048576") == 1 << 20
    with pytest.raises(SpecError, match="not a memory quantity"):
        quantity("lots")
    assert pod_memory(pod("a", "n", "64Mi")) == (64 << 20, "requests")
    memory, basis = pod_memory(pod("a", "n", None))
    assert memory == 256 << 20 and "no memory request" in basis


def test_the_spec_gives_a_deadline_or_names_the_field_at_fault() -> None:
    spec, deadline = ev.validate_spec({"nodeName": "node-a"}, "2026-12-04T10:00:00Z")
    assert deadline == ev.epoch("2026-12-04T10:02:00Z") and spec["deadlineSeconds"] == 120
    _, deadline = ev.validate_spec({"nodeName": "node-a", "deadline": "2026-12-04T11:00:30+01:00"}, None)
    assert deadline == ev.epoch("2026-12-04T10:00:30Z")
    with pytest.raises(SpecError, match=r"spec\.deadlineSeconds"):
        ev.validate_spec({"nodeName": "node-a", "deadlineSeconds": 0}, None)
    with pytest.raises(SpecError, match=r"spec\.targetNodes: 'node-a' is the node being emptied"):
        ev.validate_spec({"nodeName": "node-a", "targetNodes": ["node-a"]}, None)
    with pytest.raises(SpecError, match=r"spec\.deadline: .* not an RFC 3339"):
        ev.validate_spec({"nodeName": "node-a", "deadline": "tomorrow"}, None)


def test_a_spot_taint_or_a_cordon_is_a_sign_with_its_deadline() -> None:
    table = ev.triggers(None) if ev.TRIGGERS_ENV not in __import__("os").environ else dict(ev.TRIGGERS)
    spot = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule", "timeAdded": "2026-12-04T10:00:00Z"}
    assert ev.trigger_of(node("a", taints=[spot]), table, 0.0) == (spot["key"], ev.epoch("2026-12-04T10:02:00Z"))
    assert ev.trigger_of(node("a", unschedulable=True), table, 100.0) == (ev.DRAIN, 700.0)
    assert ev.trigger_of(node("a", taints=[{"key": "other", "effect": "NoSchedule"}]), table, 0.0) is None
    assert ev.triggers("") == {} and ev.triggers(f"{ev.DRAIN}=60") == {ev.DRAIN: 60.0}
    with pytest.raises(SpecError, match="is not key=seconds"):
        ev.triggers("nonsense")


def test_the_survey_moves_the_pods_and_says_why_it_leaves_the_others() -> None:
    objs = {
        "/api/v1/nodes/node-a": node("node-a"),
        "/api/v1/nodes/node-b": node("node-b", "2Gi"),
        "/api/v1/nodes/node-c": node("node-c", taints=[{"key": "x", "effect": "NoSchedule"}]),
        "/api/v1/namespaces/default/pods/web": pod("web", "node-a", "512Mi"),
        "/api/v1/namespaces/default/pods/agent": pod("agent", "node-a", "64Mi",
                                                      annotations={"kubernetes.io/config.mirror": "x"}),
        "/api/v1/namespaces/default/pods/ds": pod("ds", "node-a", "64Mi", ownerReferences=[{"kind": "DaemonSet"}]),
        "/api/v1/namespaces/default/pods/there": pod("there", "node-b", "256Mi"),
    }  # fmt: skip
    e = evacuator(objs, {"nodeName": "node-a"})
    moving, skipped = e.survey("node-a")
    assert [p["name"] for p in moving] == ["web"]
    assert {s["name"]: s["why"][:8] for s in skipped} == {"agent": "a static", "ds": "a DaemonS"[:8]}
    targets = e.targets("node-a", [], set())
    assert [(t.name, t.memory_free) for t in targets] == [("node-b", (2 << 30) - (256 << 20))]  # node-c is tainted
    fits = e.plan(moving, targets, 120.0)
    assert fits.steps[0].action == "migrate" and fits.steps[0].mode == "stop-copy" and fits.steps[0].target == "node-b"
    short = e.plan(moving, targets, 3.0)  # stop-copy of 512 MiB takes ~11 s here; a cold restart ~1.4 s
    assert short.steps[0].action == "restart" and "state" in short.steps[0].why
    assert e.plan(moving, targets, 1.0).steps[0].action == "lost"
    assert e.plan(moving, [], 120.0).steps[0].action == "lost"


def test_a_tainted_node_is_a_target_only_for_pods_that_all_tolerate_its_taints() -> None:
    from podmigrate.k8s.evacuator import tolerates

    gpu = {"key": "gpu", "value": "true", "effect": "NoSchedule"}
    assert tolerates([{"key": "gpu", "operator": "Equal", "value": "true"}], gpu)
    assert tolerates([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}], gpu)
    assert tolerates([{"operator": "Exists"}], gpu)  # tolerates everything
    assert not tolerates([{"key": "gpu", "value": "false"}], gpu)
    assert not tolerates([{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}], gpu)
    assert not tolerates([], gpu)
    gone = {"key": "spot", "effect": "NoExecute"}
    assert not tolerates([{"key": "spot", "operator": "Exists", "tolerationSeconds": 30}], gone)  # evicted soon
    assert tolerates([{"key": "spot", "operator": "Exists"}], gone)
    web = pod("web", "node-a", "256Mi")
    web["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    objs = {
        "/api/v1/nodes/node-a": node("node-a"),
        "/api/v1/nodes/node-b": node("node-b", taints=[gpu]),
        "/api/v1/nodes/node-c": node("node-c", taints=[gpu], unschedulable=True),  # cordoned: never a target
        "/api/v1/namespaces/default/pods/web": web,
        "/api/v1/namespaces/default/pods/db": pod("db", "node-a", "256Mi"),
    }
    e = evacuator(objs, {"nodeName": "node-a"})
    assert [t.name for t in e.targets("node-a", [], set(), ["default/web"])] == ["node-b"]
    assert [t.name for t in e.targets("node-a", [], set(), ["default/web", "default/db"])] == []  # db does not
    assert e.targets("node-a", [], set()) == []  # nothing said about the pods: tainted nodes are out
