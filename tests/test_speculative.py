"""The speculative restore's parts without a lab (runtime.speculative): podman's export form of its
configuration, the criu gate run by a stand-in for runc as runc runs criu, and a gate's placing of a
checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from podmigrate.errors import RuntimeBackendError
from podmigrate.runtime import criu_conf, speculative
from podmigrate.runtime.speculative import TOKEN, Gate, export_config

from .conftest import wait_for


def test_the_configuration_is_written_as_podmans_export_writes_it():
    config: dict[str, Any] = {
        "id": "e1e085d334384a9fdeebebe60300f37d06e5779186262db8fdf9bbc251f8e766",
        "name": "big",
        "newNetworks": {
            "mig": {"aliases": ["e1e085d33438", "e1e085d33438"], "interface_name": "eth0"},
            "other": {"aliases": ["web", "e1e085d33438"]},
        },
    }
    out = export_config(config)
    assert out["newNetworks"] == {"mig": {"interface_name": "eth0"}, "other": {"aliases": ["web"]}}
    assert config["newNetworks"]["mig"]["aliases"] == ["e1e085d33438", "e1e085d33438"]  # not changed in place
    assert export_config({"id": "x", "name": "n"}) == {"id": "x", "name": "n"}


# a stand-in for runc: named runc (the gate holds only runc's restores), it holds the image
# directory open as runc does (CRIU opens it through /proc/<runc>/fd) and runs the gate as criu
_RUNC = """
import os, subprocess, sys
img = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
sys.exit(subprocess.run(sys.argv[2:]).returncode)
"""


@pytest.fixture
def gated(tmp_path: Path):
    """The criu gate with its gates under tmp_path, a criu that records its arguments, and a runc."""
    gates, bundle = tmp_path / "gates", tmp_path / "bundle"
    img = bundle / "checkpoint"
    for d in (gates, img):
        d.mkdir(parents=True)
    ran = tmp_path / "criu-ran"
    criu = tmp_path / "real-criu"
    runc_conf, seen = tmp_path / "runc.conf", tmp_path / "criu-read"
    runc_conf.write_text("manage-cgroups=ignore\n")
    # what CRIU would read as runc's configuration file, written where the test can see it
    criu.write_text(f'#!/bin/sh\necho "$@" > {ran}\ncat {runc_conf} > {seen}\n')
    criu.chmod(0o755)
    script = tmp_path / "criu"
    runs = tmp_path / "runs"
    runs.mkdir()
    script.write_text(speculative.criu_gate(gates, str(criu), runc_conf=runc_conf, runs=runs))
    script.chmod(0o755)
    runc = tmp_path / "runc"
    runc.symlink_to(sys.executable)

    def run(*args: str, parent: Path = runc, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(parent), "-c", _RUNC, str(img), str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )

    return {
        "gates": gates,
        "img": img,
        "bundle": bundle,
        "ran": ran,
        "run": run,
        "script": script,
        "tmp": tmp_path,
        "runc_conf": runc_conf,
        "seen": seen,
        "runs": runs,
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of CRIU's own needs root")
def test_a_run_with_options_of_its_own_reads_them_as_runc_conf_and_nobody_else_does(gated):
    """podmigrate's criu binds a run's own file over runc.conf for that CRIU alone (criu_conf)."""
    own = gated["tmp"] / "run-1.conf"
    own.write_text("manage-cgroups=ignore\nlazy-pages\nport=27001\n")
    env = {**os.environ, criu_conf.RUN_ENV: str(own)}
    p = gated["run"]("swrk", "3", env=env)
    assert p.wait(10) == 0, p.stderr.read() if p.stderr else ""
    assert gated["seen"].read_text() == own.read_text()
    assert gated["ran"].read_text().split() == ["swrk", "3"]
    assert gated["runc_conf"].read_text() == "manage-cgroups=ignore\n"  # the node's, untouched
    p = gated["run"]("swrk", "3")  # a run without: the node's file
    assert p.wait(10) == 0 and gated["seen"].read_text() == "manage-cgroups=ignore\n"
    missing = {**os.environ, criu_conf.RUN_ENV: str(gated["tmp"] / "gone.conf")}
    p = gated["run"]("swrk", "3", env=missing)  # a file already removed: the node's, not a failure
    assert p.wait(10) == 0 and gated["seen"].read_text() == "manage-cgroups=ignore\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of CRIU's own needs root")
def test_a_checkpoint_s_own_options_are_found_by_the_container_id_runc_was_given(gated):
    """podman runs runc's checkpoints with an environment of its own: the file is named by the ID
    (runc's last argument; here the stand-in's, "c0ffee")."""
    (gated["runs"] / "id-c0ffee.conf").write_text("manage-cgroups=ignore\npage-server\n")
    p = gated["run"]("swrk", "c0ffee")
    assert p.wait(10) == 0 and gated["seen"].read_text() == "manage-cgroups=ignore\npage-server\n"
    other = gated["tmp"] / "podman"  # not runc's run (podman's own CRIU check): the node's file
    other.symlink_to(sys.executable)
    p = gated["run"]("swrk", "c0ffee", parent=other)
    assert p.wait(10) == 0 and gated["seen"].read_text() == "manage-cgroups=ignore\n"


def test_the_criu_gate_passes_every_other_run_straight_to_criu(gated):
    for args in (("swrk", "3"), ("check",)):  # runc's own runs: no token in the image directory
        p = gated["run"](*args)
        assert p.wait(10) == 0
        assert gated["ran"].read_text().split() == list(args)
    (gated["img"] / TOKEN).write_text("cp-0")
    other = gated["tmp"] / "podman"  # a token, but not runc's run: podman's own CRIU check
    other.symlink_to(sys.executable)
    p = gated["run"]("swrk", "3", parent=other)
    assert p.wait(10) == 0 and gated["ran"].read_text().split() == ["swrk", "3"]


def test_a_gated_restore_waits_and_runs_criu_on_go(gated):
    (gated["img"] / TOKEN).write_text("cp-1")
    os.mkfifo(gated["gates"] / "cp-1.fifo", 0o600)
    gate = Gate("cp-1", "", gated["run"]("swrk", "3"), time.time(), gates=gated["gates"])
    gate.wait(10)
    assert (gate.img, gate.bundle) == (gated["img"], gated["bundle"])
    assert gate.alive() and not gated["ran"].exists()
    gate.release()
    rc, _ = gate.finish(10)
    assert rc == 0 and gated["ran"].read_text().split() == ["swrk", "3"]
    assert not list(gated["gates"].iterdir())  # its FIFO and notes are gone


def test_a_cancelled_gate_never_runs_criu(gated):
    (gated["img"] / TOKEN).write_text("cp-2")
    os.mkfifo(gated["gates"] / "cp-2.fifo", 0o600)
    gate = Gate("cp-2", "", gated["run"]("swrk", "3"), time.time(), gates=gated["gates"])
    gate.wait(10)
    gate.cancel()
    assert gate.proc.returncode == 1 and not gated["ran"].exists()
    assert not list(gated["gates"].iterdir())


def test_a_gate_whose_agent_went_away_fails_the_restore(gated):
    """The agent's FIFO descriptor closes with it: the gate reads EOF and gives up."""
    (gated["img"] / TOKEN).write_text("cp-3")
    os.mkfifo(gated["gates"] / "cp-3.fifo", 0o600)
    gate = Gate("cp-3", "", gated["run"]("swrk", "3"), time.time(), gates=gated["gates"])
    gate.wait(10)
    os.close(gate.fd)
    assert gate.proc.wait(10) == 1 and not gated["ran"].exists()


def test_a_gated_restore_without_its_fifo_is_refused_and_the_wait_says_why(gated):
    (gated["img"] / TOKEN).write_text("cp-4")  # its FIFO gone: cancelled before runc got there
    gate = Gate.__new__(Gate)
    gate.token, gate.name, gate.gates = "cp-4", "ctr", gated["gates"]
    gate.proc = gated["run"]("swrk", "3")
    wait_for(lambda: gate.proc.poll() is not None, 10, "the gate ended")
    with pytest.raises(Exception, match="did not reach its gate \\(podman exited 1\\)"):
        gate.wait(10)
    assert not gated["ran"].exists()


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_gate_places_the_checkpoint_where_podmans_import_would_have(tmp_path: Path):
    root, shm, img, bundle = (tmp_path / d for d in ("merged", "shm", "img", "bundle"))
    for d in (root / "etc", root / "var", shm, img, bundle):
        d.mkdir(parents=True)
    (root / "etc" / "gone").write_text("deleted in the container")
    (root / "var" / "old").write_text("before")
    (tmp_path / "outside").write_text("not the container's")
    (img / TOKEN).write_text("cp")
    (img / "inventory.img").write_bytes(b"")  # the skeleton's placeholder
    (bundle / "config.json").write_text(json.dumps({"root": {"path": str(root)}}))
    archive = tmp_path / "cp.tar"
    archive.write_bytes(
        _tar(
            {
                "config.dump": json.dumps({"ShmDir": str(shm)}).encode(),
                "checkpoint/inventory.img": b"real inventory",
                "checkpoint/pagemap-1.img": b"pagemap",
                "rootfs-diff.tar": _tar({"var/old": b"after", "var/new": b"new file"}),
                "deleted.files": json.dumps(["/etc/gone", "/../outside"]).encode(),
                "devshm-checkpoint.tar": _tar({"./seg": b"shared"}),
            }
        )
    )
    gate = Gate.__new__(Gate)
    gate.img, gate.bundle = img, bundle
    gate.place(archive)
    assert sorted(p.name for p in img.iterdir()) == ["inventory.img", "pagemap-1.img"]
    assert (img / "inventory.img").read_bytes() == b"real inventory"
    assert (root / "var" / "old").read_text() == "after" and (root / "var" / "new").read_text() == "new file"
    assert not (root / "etc" / "gone").exists()
    assert (tmp_path / "outside").exists()  # a path out of the root is never followed
    assert (shm / "seg").read_text() == "shared"
    assert not (bundle / "podmigrate-staging").exists()


def test_a_checkpoint_that_does_not_unpack_is_refused_at_the_gate(tmp_path: Path):
    img, bundle = tmp_path / "img", tmp_path / "bundle"
    img.mkdir()
    bundle.mkdir()
    (img / TOKEN).write_text("cp")
    archive = tmp_path / "cp.tar"
    archive.write_bytes(b"not a checkpoint")
    gate = Gate.__new__(Gate)
    gate.img, gate.bundle = img, bundle
    with pytest.raises(Exception, match="unpacking the checkpoint at the gate failed"):
        gate.place(archive)
    assert (img / TOKEN).exists() and not (bundle / "podmigrate-staging").exists()


class _Gate:
    released = False

    def __init__(self) -> None:
        self.cancelled = 0

    def alive(self) -> bool:
        return True

    def cancel(self) -> None:
        self.cancelled += 1


class _FailingRuntime:
    def lazy_restore(self, *args: Any, **kw: Any) -> Any:
        raise RuntimeBackendError("unpacking the lazy checkpoint failed: not a checkpoint")


def test_a_restore_that_fails_before_its_gate_opens_cancels_the_waiting_podman_at_once(tmp_path: Path):
    """Else it would wait for runc-gate's own timeout, holding the container's lock meanwhile."""
    from podmigrate.agent.checkpoints import CheckpointDir
    from podmigrate.agent.memory import Reservations
    from podmigrate.agent.node_lazy import LazyPages
    from podmigrate.agent.node_speculative import Speculations
    from podmigrate.agent.peers import Peers

    files = CheckpointDir(tmp_path)
    speculations = Speculations(_FailingRuntime(), files)  # type: ignore[arg-type]
    gate = _Gate()
    speculations.gates["c1"] = gate  # type: ignore[assignment]
    lazy = LazyPages(Peers("node-b"), _FailingRuntime(), files, Reservations(), speculations=speculations)  # type: ignore[arg-type]
    with pytest.raises(RuntimeBackendError, match="not a checkpoint"):
        lazy.restore_lazy({"cid": "c1"}, {"speculative": True, "address": "10.77.0.11", "port": 27001})
    assert gate.cancelled == 1 and not speculations.gates


def test_paths_a_checkpoint_names_never_reach_out_of_the_containers_root(tmp_path: Path):
    """The workload controls its root: a symbolic link there to a node path must not let a deleted
    or changed file of its checkpoint touch the node (they are applied chrooted into the root)."""
    outside = tmp_path / "node"
    outside.mkdir()
    (outside / "victim").write_text("the node's")
    root, img, bundle = tmp_path / "merged", tmp_path / "img", tmp_path / "bundle"
    for d in (root, img, bundle):
        d.mkdir()
    (root / "etc2").symlink_to(outside)  # absolute: inside the chroot it points at nothing
    (img / TOKEN).write_text("cp")
    (bundle / "config.json").write_text(json.dumps({"root": {"path": str(root)}}))
    gate = Gate.__new__(Gate)
    gate.img, gate.bundle = img, bundle
    removal = tmp_path / "removal.tar"
    removal.write_bytes(
        _tar({"config.dump": b"{}", "checkpoint/inventory.img": b"i", "deleted.files": b'["/etc2/victim"]'})
    )
    gate.place(removal)
    assert (outside / "victim").read_text() == "the node's"
    planting = tmp_path / "planting.tar"
    planting.write_bytes(
        _tar({"config.dump": b"{}", "checkpoint/inventory.img": b"i", "rootfs-diff.tar": _tar({"etc2/planted": b"x"})})
    )
    with contextlib.suppress(RuntimeBackendError):  # refused, or written inside the root: never outside
        gate.place(planting)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_a_dead_agents_waiting_restore_is_cleaned_by_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The agent died with a restore at its gate: the gate read EOF, podman failed and left the
    container created. Only the name file says so; a released gate's restore is CRIU's, not an orphan."""
    podman: list[list[str]] = []
    running = {"web": "false", "api": "true"}

    def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        podman.append(argv[1:])
        return subprocess.CompletedProcess(argv, 0, running.get(argv[-1], "") + "\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    for token, name in (("m1", "web"), ("m2", "api")):
        (tmp_path / f"{token}.name").write_text(name)
        (tmp_path / f"{token}.waiting").write_text("/img\n/bundle\n")
        os.mkfifo(tmp_path / f"{token}.fifo")
    (tmp_path / "m3.fifo").touch()  # a live gate released: no name file
    assert speculative.orphans(tmp_path) == ["m1", "m2"]
    assert speculative.clean_orphan("m1", tmp_path) == "web"
    assert ["rm", "-f", "-t", "0", "--", "web"] in podman and ["rm", "--storage", "--", "web"] in podman
    podman.clear()
    # a container of that name that runs is not a failed restore's: only the files go
    assert speculative.clean_orphan("m2", tmp_path) == "api"
    assert podman == [["inspect", "-f", "{{.State.Running}}", "--", "api"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m3.fifo"]
    assert speculative.clean_orphan("m1", tmp_path) is None and speculative.orphans(tmp_path) == []
