"""Which restore path a node gets (``k8s.runtimes``), and the RuntimeClass handler's decisions
(``runtime.runc_restore``) on real bundles and directories, with a stand-in for runc that records
its argv (the real runc restore runs in ``tests/test_kube_operator.py`` and ``tests/test_kube_faults.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from podmigrate.k8s import runtimes
from podmigrate.runtime import runc_restore as rr


def node(version: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"labels": labels or {}}, "status": {"nodeInfo": {"containerRuntimeVersion": version}}}


@pytest.mark.parametrize(
    ("version", "wanted", "rc", "path", "why"),
    [
        ("containerd://2.1.9", "auto", True, "cri", "restores checkpoint images through CRI"),
        ("containerd://2.3.0", "auto", False, "cri", "through CRI"),
        ("containerd://2.4.0", "auto", True, "runtimeclass", "removed in 2.4"),
        ("containerd://2.0.5", "auto", True, "runtimeclass", "added in 2.1"),
        ("containerd://2.4.0", "auto", False, None, "(removed in 2.4); no podmigrate RuntimeClass"),
        ("containerd://2.1.9", "runtimeclass", True, "runtimeclass", "RuntimeClass"),
        ("containerd://2.4.0", "cri", True, None, "removed in 2.4"),
        ("cri-o://1.34.1", "auto", False, None, "off by default"),
        ("cri-o://1.34.1", "auto", True, "runtimeclass", "off by default"),
        ("", "auto", False, None, "an unreported runtime"),
    ],
)
def test_the_restore_path_follows_the_nodes_runtime(version, wanted, rc, path, why):
    got, reason = runtimes.choose(wanted, node(version), rc)
    assert got == path and why in reason, (got, reason)


def test_cri_o_with_restore_on_says_so_with_a_label():
    labelled = node("cri-o://1.34.1", {runtimes.CRI_RESTORE_LABEL: "true"})
    assert runtimes.choose("auto", labelled, False)[0] == "cri"


def test_runc_arguments_are_split_into_global_command_options_and_id():
    argv = ["--root", "/run/r", "--log", "/x/log.json", "--log-format", "json", "create", "--bundle", "/b",
            "--pid-file", "/b/init.pid", "--no-pivot", "cid"]  # fmt: skip
    glob, cmd, opts, cid = rr.parse(argv)
    assert glob == ["--root", "/run/r", "--log", "/x/log.json", "--log-format", "json"]
    assert (cmd, cid) == ("create", "cid")
    assert opts == {"--bundle": "/b", "--pid-file": "/b/init.pid", "--no-pivot": True}


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    """A bundle, a restore directory, a state directory and a fake runc that logs its argv."""
    bundle, restore, state = tmp_path / "bundle", tmp_path / "restore", tmp_path / "state"
    (bundle / "rootfs").mkdir(parents=True)
    restore.mkdir()
    runc = tmp_path / "runc"
    runc.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/runc.argv\nexit ${{FAKE_RC:-0}}\n')
    runc.chmod(0o755)
    conf = tmp_path / "conf.json"
    conf.write_text(json.dumps({"runc": str(runc), "state": str(state), "restore_dir": str(restore)}))
    return {"bundle": bundle, "restore": restore, "state": state, "conf": conf, "tmp": tmp_path}


def wrapper(
    w: dict[str, Path], annotations: dict[str, str], cmd: str = "create", rc: int = 0
) -> subprocess.CompletedProcess[str]:
    (w["bundle"] / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "annotations": annotations}))
    script = (
        "import sys, pathlib; import podmigrate.runtime.runc_restore as r; "
        f"r.CONFIG = pathlib.Path({str(w['conf'])!r}); sys.exit(r.main(sys.argv[1:]))"
    )
    log = w["tmp"] / "log.json"
    return subprocess.run(
        [sys.executable, "-c", script, "--log", str(log), cmd, "--bundle", str(w["bundle"]), "--pid-file", "p", "cid"],
        capture_output=True, text=True, env={**os.environ, "FAKE_RC": str(rc)},
    )  # fmt: skip


def checkpoint(w: dict[str, Path], verified: bool = True) -> Path:
    d = w["restore"] / "m1" / "server"
    (d / "checkpoint").mkdir(parents=True)
    (d / "checkpoint" / "descriptors.json").write_text("[]")
    if verified:
        (d / "podmigrate-verified.json").write_text("{}")
    return d


CTR = {"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.container-name": "server",
       "io.kubernetes.cri.sandbox-id": "sb1"}  # fmt: skip


def test_a_container_with_no_restore_is_plain_runc(world):
    p = wrapper(world, CTR)
    assert p.returncode == 0, p.stderr
    assert (world["tmp"] / "runc.argv").read_text().split()[2:4] == ["create", "--bundle"]


def test_a_verified_checkpoint_is_restored_once_per_sandbox(world):
    src = checkpoint(world)
    ann = {**CTR, "io.podmigrate.restore": "server", "io.podmigrate.restore-from.server": str(src)}
    p = wrapper(world, ann)
    assert p.returncode == 0, p.stderr
    argv = (world["tmp"] / "runc.argv").read_text().split()
    assert argv[2:5] == ["restore", "--detach", "--no-subreaper"] and f"{src}/checkpoint" in argv
    assert wrapper(world, ann, "start").returncode == 0  # already running: start is a no-op
    assert len((world["tmp"] / "runc.argv").read_text().splitlines()) == 1
    wrapper(world, ann)  # a restart in the same sandbox: fresh, not the old memory again
    assert (world["tmp"] / "runc.argv").read_text().splitlines()[-1].split()[2] == "create"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-source", "no io.podmigrate.restore-from.server reached the runtime"),
        ("unverified", "has no podmigrate-verified.json"),
        ("outside", "is not a checkpoint directory under"),
        ("restore-fails", "runc restore from"),
    ],
)
def test_a_restore_that_cannot_happen_is_refused_with_its_reason_never_a_fresh_start(world, case, message):
    src = checkpoint(world, verified=case != "unverified")
    ann = {**CTR, "io.podmigrate.restore": "server", "io.podmigrate.restore-from.server": str(src)}
    if case == "no-source":
        del ann["io.podmigrate.restore-from.server"]
    if case == "outside":
        ann["io.podmigrate.restore-from.server"] = str(world["tmp"])
    p = wrapper(world, ann, rc=1 if case == "restore-fails" else 0)
    assert p.returncode != 0 and message in p.stderr, p.stderr
    last = json.loads((world["tmp"] / "log.json").read_text().splitlines()[-1])  # what the shim reports
    assert last["level"] == "error" and message in last["msg"]
    argv = world["tmp"] / "runc.argv"
    assert not argv.exists() or "create" not in argv.read_text()  # never created fresh
