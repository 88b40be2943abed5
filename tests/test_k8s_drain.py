"""The eviction webhook's decisions (``k8s.drain.review``) against a fake API (a dict of objects: fast,
no cluster), and the Secrets ``podmigrate k8s secrets`` makes. ``tests/test_kube_operator.py`` runs the
webhook for real: ``kubectl drain`` on upstream Kubernetes."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from cryptography import x509

from podmigrate.cli import main
from podmigrate.k8s import api as k
from podmigrate.k8s import drain
from podmigrate.k8s.agents import Config

ME = {"name": "podmigrate-operator-x", "namespace": "podmigrate-system", "node": "node-a"}


class FakeAPI:
    """Fake (in memory): pods and PodLiveMigrations by path; ``created`` records what was made."""

    def __init__(self, pods: list[dict[str, Any]], plms: list[dict[str, Any]] | None = None) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.plms = list(plms or [])
        self.created: list[dict[str, Any]] = []

    def get(self, path: str) -> dict[str, Any] | None:
        parts = path.strip("/").split("/")  # api v1 namespaces NS pods NAME
        return self.pods.get((parts[3], parts[5]))

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list[Any]:
        if path.endswith("/podlivemigrations"):
            ns = path.split("/")[5]
            return [m for m in self.plms if m["metadata"]["namespace"] == ns]
        assert path == "/api/v1/pods" and field_selector
        node = field_selector.removeprefix("spec.nodeName=")
        return [p for p in self.pods.values() if p["spec"]["nodeName"] == node]

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        made = {**obj, "metadata": {**obj["metadata"], "name": obj["metadata"]["generateName"] + "abcde"}}
        self.created.append(made)
        return made


def pod(name: str, node: str = "node-a", ns: str = "default", opted: bool = True) -> dict[str, Any]:
    labels = {"app": name, **({"podmigrate.io/drain": "migrate"} if opted else {})}
    return {"metadata": {"name": name, "namespace": ns, "labels": labels}, "spec": {"nodeName": node}}


def plm(name: str, pod_name: str, phase: str, ns: str = "default", at: str = "2026-12-06T17:00:00Z") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": at}, "spec": {"podName": pod_name},
            "status": {"phase": phase, "message": f"it {phase}"}}  # fmt: skip


def evict(api: FakeAPI, name: str, ns: str = "default", dry: bool = False) -> dict[str, Any]:
    body = {"request": {"uid": "u1", "namespace": ns, "name": name, "dryRun": dry}}
    out: dict[str, Any] = drain.admit(api, Config(), body, ME)["response"]  # type: ignore[arg-type]
    return out


def test_an_opted_in_pod_is_held_while_a_migration_is_made_for_it() -> None:
    api = FakeAPI([pod("web")])
    r = evict(api, "web")
    assert r["uid"] == "u1" and not r["allowed"] and r["status"]["code"] == 429
    assert [c["spec"] for c in api.created] == [{"podName": "web"}]
    assert "PodLiveMigration drain-web-abcde" in r["status"]["message"]
    # the next try finds it running and makes no second one
    api.plms.append(plm("drain-web-abcde", "web", "Checkpointing"))
    r = evict(api, "web")
    assert not r["allowed"] and "Checkpointing" in r["status"]["message"] and len(api.created) == 1


def test_other_pods_dry_runs_and_gone_pods_are_let_through_untouched() -> None:
    api = FakeAPI([pod("plain", opted=False), pod("web")])
    assert evict(api, "plain")["allowed"]
    assert evict(api, "web", dry=True)["allowed"]  # sideEffects: NoneOnDryRun
    assert evict(api, "nothing-here")["allowed"]
    assert api.created == []


def test_a_pod_being_moved_is_held_even_if_it_never_opted_in() -> None:
    api = FakeAPI([pod("db", opted=False)], [plm("db-ev1", "db", "Restoring")])
    assert evict(api, "db")["status"]["code"] == 429 and api.created == []


def test_a_failed_migration_lets_the_drain_finish_and_says_the_state_is_lost() -> None:
    earlier = plm("old", "web", "Completed", at="2026-12-06T16:00:00Z")
    api = FakeAPI([pod("web")], [earlier, plm("new", "web", "RolledBack")])
    r = evict(api, "web")
    assert r["allowed"] and "state is lost" in r["warnings"][0] and "it RolledBack" in r["warnings"][0]
    assert api.created == []


def test_the_operator_leaves_its_node_only_after_the_pods_it_must_move() -> None:
    me = pod(ME["name"], ns=ME["namespace"], opted=False)
    api = FakeAPI([me, pod("web")])
    r = evict(api, ME["name"], ME["namespace"])
    assert not r["allowed"] and "after default/web has moved" in r["status"]["message"]
    api.pods.pop(("default", "web"))
    assert evict(api, ME["name"], ME["namespace"])["allowed"]


def test_a_failure_of_the_webhook_lets_the_eviction_through_with_a_warning() -> None:
    class Broken(FakeAPI):
        def get(self, path: str) -> dict[str, Any] | None:
            raise k.KubeError("the API server is away", details={"status": 503})

    r = evict(Broken([]), "web")
    assert r["allowed"] and "KubeError" in r["warnings"][0]


def test_k8s_secrets_makes_the_manifests_secrets_and_keeps_its_ca(tmp_path: Path) -> None:
    run = CliRunner().invoke(main, ["k8s", "secrets", "--dir", str(tmp_path / "ca")])
    assert run.exit_code == 0, run.output
    items = {s["metadata"]["name"]: s for s in json.loads(run.output)["items"]}
    assert set(items) == {"podmigrate-agent-tls", "podmigrate-operator-tls", "podmigrate-seal-key"}
    op = items["podmigrate-operator-tls"]
    assert op["metadata"]["namespace"] == "podmigrate-system" and set(op["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    cert = x509.load_pem_x509_certificate(base64.b64decode(op["data"]["tls.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "podmigrate-webhook.podmigrate-system.svc" in sans  # the eviction webhook's Service
    assert len(base64.b64decode(items["podmigrate-seal-key"]["data"]["key"])) == 64
    assert oct((tmp_path / "ca" / "seal.key").stat().st_mode & 0o777) == "0o600"
    rerun = CliRunner().invoke(main, ["k8s", "secrets", "--dir", str(tmp_path / "ca")])
    again = {s["metadata"]["name"]: s for s in json.loads(rerun.output)["items"]}
    assert again["podmigrate-seal-key"] == items["podmigrate-seal-key"]
    assert again["podmigrate-agent-tls"]["data"]["ca.crt"] == items["podmigrate-agent-tls"]["data"]["ca.crt"]
