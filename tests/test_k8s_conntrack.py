"""The agent's deletion of a moved pod's connection-tracking entries (``k8s.conntrack``), against a
fake ``conntrack`` tool on the PATH (named as such: it records its arguments and answers as
conntrack-tools 1.4 does); the real one runs on the lab's cluster in every migration's cleanup."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from podmigrate.errors import AgentError, UsageError
from podmigrate.k8s import api as k
from podmigrate.k8s import conntrack
from podmigrate.k8s.agents import Config
from podmigrate.k8s.context import Ctx, K8sRecord

from .fake_kube import FakeKubeAPI


def fake_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str, rc: int = 0) -> Path:
    calls = tmp_path / "calls"
    tool = tmp_path / "bin" / "conntrack"
    tool.parent.mkdir()
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "{answer}" >&2\nexit {rc}\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_the_tcp_entries_whose_reply_comes_from_the_address_are_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_tool(tmp_path, monkeypatch, "conntrack v1.4.8 (conntrack-tools): 3 flow entries have been deleted.")
    assert conntrack.forget({"addresses": ["10.244.1.7"]}) == {"deleted": {"10.244.1.7": 3}}
    assert calls.read_text().split() == ["-D", "-p", "tcp", "--reply-src", "10.244.1.7"]


def test_an_agent_not_permitted_says_so_and_does_not_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tool(tmp_path, monkeypatch, "conntrack v1.4.8 (conntrack-tools): Operation not permitted", rc=1)
    assert conntrack.forget({"addresses": ["10.244.1.7"]}) == {
        "skipped": "conntrack v1.4.8 (conntrack-tools): Operation not permitted"
    }


def test_without_the_tool_nothing_is_deleted_and_it_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _name: None)
    assert conntrack.forget({"addresses": ["10.244.1.7"]}) == {"skipped": "no conntrack tool in the agent's image"}


def test_an_address_that_is_not_one_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = fake_tool(tmp_path, monkeypatch, "0 flow entries have been deleted.")
    with pytest.raises(UsageError, match="not pod addresses"):
        conntrack.forget({"addresses": ["10.244.1.7", "--flush"]})
    assert not calls.exists()


def test_every_node_is_asked_and_one_without_an_agent_is_recorded() -> None:
    api = FakeKubeAPI()
    for n in ("node-a", "node-b"):
        api.objects[k.nodes(n)] = {"metadata": {"name": n}}
    asked: list[tuple[str, Any]] = []

    def call(node: str, path: str, body: dict[str, Any], timeout: float = 0) -> Any:
        asked.append((node, body))
        if node == "node-b":
            raise AgentError("no ready podmigrate agent on node 'node-b'")
        return {"deleted": {"10.244.1.7": 2}}

    ctx = Ctx(api, SimpleNamespace(call=call), Config(), "default", "m", {}, K8sRecord(), lambda *e: None)  # type: ignore[arg-type]
    done = conntrack.forget_source(ctx, "10.244.1.7")
    assert asked == [("node-a", {"addresses": ["10.244.1.7"]}), ("node-b", {"addresses": ["10.244.1.7"]})]
    assert done["node-a"] == {"deleted": {"10.244.1.7": 2}}
    assert "no ready podmigrate agent" in done["node-b"]["skipped"]
    assert conntrack.forget_source(ctx, "") == {}
