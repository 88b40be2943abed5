"""The ``Runtime`` protocol against its users and its implementation (no root, no lab, no podman).

Which verbs the agent uses is read from its source with ``ast``, so that a new call cannot slip past
the protocol. Every ``src/podmigrate/agent/**/*.py`` file is scanned (the agent may be split into
several modules). In each, the names bound to the runtime are: ``rt`` and ``runtime`` (today's and
the obvious names, unless the file imports something under that name), every name or attribute
assigned from a call of a runtime class (``rt = Podman(name)``, ``self.backend = Podman(name)``), and
every parameter or attribute annotated with ``Runtime`` or a runtime class. A verb is any attribute
read from such a name, called or not: ``rt.x``, ``self.rt.x``, ``app.runtime.x``. If the agent ever
reaches its runtime some other way, the scan finds too few verbs and says so.

mypy checks that ``Podman`` conforms to the protocol (``runtime/podman.py``); the tests here check
what mypy cannot: the defaults of the protocol are Podman's, and the capability record's keys.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podmigrate.runtime import criu_conf
from podmigrate.runtime import podman as podman_mod
from podmigrate.runtime.base import NodeCapabilities, Runtime
from podmigrate.runtime.podman import Podman

AGENT = Path(__file__).resolve().parents[1] / "src" / "podmigrate" / "agent"
RUNTIME_CLASSES = {"Podman", "Runtime"}
CONVENTIONAL = {"rt", "runtime"}


def _bound_name(node: ast.expr) -> str | None:
    """``x`` for ``x`` and for ``<anything>.x``: the name a runtime is kept under."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_runtime_class(node: ast.expr | None) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return node.value.split(".")[-1] in RUNTIME_CLASSES
    return _bound_name(node) in RUNTIME_CLASSES if node is not None else False


def runtime_names(tree: ast.Module) -> set[str]:
    imported = {
        (a.asname or a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    names = CONVENTIONAL - imported
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _is_runtime_class(n.value.func):
            names |= {x for t in n.targets if (x := _bound_name(t))}
        elif isinstance(n, ast.AnnAssign) and _is_runtime_class(n.annotation):
            names |= {x for x in [_bound_name(n.target)] if x}
        elif isinstance(n, ast.arg) and _is_runtime_class(n.annotation):
            names.add(n.arg)
    return names


def verbs_the_agent_uses() -> dict[str, set[str]]:
    """Each verb read from the agent's runtime, with the files it is read in."""
    verbs: dict[str, set[str]] = {}
    for path in sorted(AGENT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = runtime_names(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _bound_name(n.value) in names:
                verbs.setdefault(n.attr, set()).add(path.name)
    return verbs


def declared(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def test_every_verb_the_agent_calls_on_its_runtime_is_in_the_protocol():
    verbs = verbs_the_agent_uses()
    # the agent drives some twenty verbs; far fewer means the scan lost track of its runtime
    assert len(verbs) >= 15 and {"checkpoint", "lazy_restore", "info"} <= verbs.keys(), sorted(verbs)
    missing = {v: sorted(files) for v, files in verbs.items() if v not in declared(Runtime)}
    assert not missing, f"the agent calls these on its runtime but base.Runtime does not declare them: {missing}"


def test_the_scan_finds_a_runtime_however_the_agent_names_it():
    tree = ast.parse(
        "from podmigrate.runtime.podman import Podman\n"
        "class Node:\n"
        "    def __init__(self, name):\n"
        "        self.backend = Podman(name)\n"
        "    def go(self):\n"
        "        return self.backend.resume('x')\n"
        "def route(r: 'Runtime'):\n"
        "    r.stop('x')\n"
    )
    assert runtime_names(tree) >= {"backend", "r", "rt", "runtime"}


def test_the_protocols_signatures_are_podmans_defaults_included():
    for verb in sorted(declared(Runtime)):
        theirs = inspect.signature(getattr(Runtime, verb)).parameters
        ours = inspect.signature(getattr(Podman, verb)).parameters
        assert [(p.name, p.kind, p.default) for p in theirs.values()] == [
            (p.name, p.kind, p.default) for p in ours.values()
        ], verb


def test_node_capabilities_has_the_documented_keys_each_with_its_reason():
    hints = typing.get_type_hints(NodeCapabilities)
    assert hints == {
        "runtime": str,
        "criu": str,
        "lazy_dump_read": bool,
        "lazy_pages": bool,
        "page_server": bool,
        "soft_dirty": bool,
        "pods": bool,
        "tcp_established": bool,
    }
    assert NodeCapabilities.__required_keys__ == set(hints)
    body = inspect.getsource(NodeCapabilities).splitlines()
    for key in hints:
        line = next(x for x in body if x.strip().startswith(f"{key}:"))
        assert "#" in line and line.split("#", 1)[1].strip(), f"{key} has no comment saying what it is for"


@pytest.fixture
def fake_tools(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, ...]]]:
    """The version commands answer as on a lab node; which ran, in order, is recorded."""
    answers = {"criu": "Version: 4.2\n", "podman": "podman version 5.4.2\n", "runc": "runc version 1.3.0\n"}
    ran: list[tuple[str, ...]] = []

    def run(cmd: tuple[str, ...], **kw: Any) -> subprocess.CompletedProcess[str]:
        ran.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 0, answers[cmd[0]], "")

    monkeypatch.setattr(subprocess, "run", run)
    criu_conf.has_option.cache_clear()  # asked once per process: this process asks the fakes
    podman_mod._probed.clear()  # versions are kept while the binaries are unchanged
    yield ran
    criu_conf.has_option.cache_clear()
    podman_mod._probed.clear()


def test_info_keeps_its_keys_and_adds_the_capabilities(fake_tools: list[tuple[str, ...]]):
    info = Podman("n1").info()
    caps = info["capabilities"]
    assert {k: info[k] for k in ("runtime", "podman", "runc", "criu")} == {
        "runtime": "podman",
        "podman": "5.4.2",
        "runc": "1.3.0",
        "criu": "4.2",
    }
    assert info["lazy_pages"] is caps["lazy_pages"] and info["soft_dirty"] is caps["soft_dirty"] is False
    assert set(caps) == set(typing.get_type_hints(NodeCapabilities))
    assert caps["criu"] == "4.2" and caps["page_server"] and caps["pods"] and caps["tcp_established"]
    # CRIU's version and usage (a CRIU whose usage has no --lazy-dump-mode is a stock one), then the rest
    assert fake_tools == [("criu", "--version"), ("criu", "--help"), ("podman", "--version"), ("runc", "--version")]
    assert caps["lazy_dump_read"] is False


def test_versions_are_asked_again_only_when_a_binary_changed_or_a_while_passed(
    fake_tools: list[tuple[str, ...]], monkeypatch: pytest.MonkeyPatch
):
    node = Podman("n1")
    node.info()
    asked = len(fake_tools)
    assert node.info()["podman"] == "5.4.2" and len(fake_tools) == asked  # every validate asks: no command ran
    binaries: dict[str, tuple[object, ...]] = {n: (f"/usr/bin/{n}", 1, 2, 3) for n in ("criu", "podman", "runc")}
    monkeypatch.setattr(podman_mod, "_binary", lambda name: binaries[name])
    node.info()  # the keys changed (a new binary): each asked once more
    assert fake_tools[asked:] == [("criu", "--version"), ("podman", "--version"), ("runc", "--version")]
    binaries["podman"] = ("/usr/bin/podman", 9, 2, 3)  # podman upgraded in place
    node.info()
    assert fake_tools[asked + 3 :] == [("podman", "--version")]
    later = time.monotonic() + podman_mod.PROBE_TTL_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    node.info()  # a while later: an upgrade behind a wrapper script is seen too
    assert len(fake_tools) == asked + 7


def test_a_node_without_criu_has_no_page_server(monkeypatch: pytest.MonkeyPatch):
    def run(cmd: tuple[str, ...], **kw: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(podman_mod, "_probed", {})
    caps = Podman("n1").capabilities()
    assert caps["criu"] == "missing" and caps["page_server"] is False
