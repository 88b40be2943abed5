"""Each CRIU run's own options (``runtime.criu_conf``): with podmigrate's criu, two migrations on one
node run their CRIU at once, each reading the node's runc.conf plus its own lines and nobody else's;
without it, the node's runc.conf is rewritten and the runs take turns. Real files and threads; the
bind over runc.conf in tests/test_speculative.py, CRIU itself in the lab tests."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from podmigrate.errors import UsageError
from podmigrate.runtime import criu_conf

DEFAULT = "manage-cgroups=ignore\nnetwork-lock=nftables\n"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    conf = tmp_path / "etc" / "runc.conf"
    conf.parent.mkdir()
    conf.write_text(DEFAULT)
    conf.with_name("runc.conf.default").write_text(DEFAULT)
    monkeypatch.setattr(criu_conf, "CRIU_CONF", conf)
    monkeypatch.setattr(criu_conf, "CRIU_RUNS", tmp_path / "runs")
    monkeypatch.setattr(criu_conf, "per_run", lambda: True)
    return tmp_path


def test_two_runs_overlap_and_each_reads_the_node_s_options_and_only_its_own(node: Path) -> None:
    both_inside = threading.Barrier(2, timeout=5)
    seen: dict[str, tuple[Path, str, str, str]] = {}

    def run(name: str, *lines: str) -> None:
        with criu_conf.criu_options(*lines) as conf:
            both_inside.wait()  # a node-wide lock would time this out
            env = criu_conf.block_env()
            assert env is not None and env[criu_conf.RUN_ENV] == str(conf)
            seen[name] = (conf, conf.read_text(), Path(env["CONTAINERS_CONF_OVERRIDE"]).read_text(), env["PATH"])

    threads = [
        threading.Thread(target=run, args=("dump", "lazy-pages", "port=1234")),
        threading.Thread(target=run, args=("restore", "network-lock=iptables")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["dump"][1] == DEFAULT + "lazy-pages\nport=1234\n"
    assert seen["restore"][1] == DEFAULT + "network-lock=iptables\n"  # last wins, as in one runc.conf
    assert seen["dump"][0] != seen["restore"][0]
    # conmon (podman's restores) is told the same file through containers.conf, its own PATH kept
    override = seen["restore"][2]
    assert f'"{criu_conf.RUN_ENV}={seen["restore"][0]}"' in override and "append=true" in override
    assert seen["dump"][3] == os.environ["PATH"]
    assert (node / "etc" / "runc.conf").read_text() == DEFAULT
    assert list((node / "runs").iterdir()) == []  # every run's files gone with its block


def test_every_run_has_its_file_and_a_thread_outside_a_block_none(node: Path) -> None:
    with criu_conf.criu_options() as conf:
        assert conf.read_text() == DEFAULT and criu_conf.block_env() is not None
        inner: list[object] = []
        t = threading.Thread(target=lambda: inner.append(criu_conf.block_env()))
        t.start()
        t.join(5)
        assert inner == [None]
    assert criu_conf.block_env() is None


def test_the_files_are_private(node: Path) -> None:
    with criu_conf.criu_options("tls", "tls-key=/secret/key.pem"):
        env = criu_conf.block_env()
        assert env is not None
        for f in (env[criu_conf.RUN_ENV], env["CONTAINERS_CONF_OVERRIDE"]):
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600


def test_a_gate_s_file_is_written_when_its_block_starts_and_kept_for_the_gate(node: Path) -> None:
    """A speculative restore's podman starts with the node's options; CRIU reads the file only at
    the gate's release, by then with the restore's own lines."""
    run = criu_conf.CriuRun("gate-cp1")
    assert run.path.read_text() == DEFAULT
    watched = os.stat(run.path).st_ino
    with criu_conf.criu_options("lazy-pages", "work-dir=/w", run=run) as conf:
        assert conf == run.path and run.path.read_text() == DEFAULT + "lazy-pages\nwork-dir=/w\n"
        assert os.stat(run.path).st_ino == watched  # written in place: an inotify watch stays on it
    assert run.path.exists()  # the gate removes it (Gate._close)
    run.remove()
    assert not run.path.exists() and not run.override.exists()


def test_without_podmigrate_s_criu_runc_conf_is_rewritten_and_the_runs_take_turns(
    node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(criu_conf, "per_run", lambda: False)
    conf = node / "etc" / "runc.conf"
    inside, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def dump() -> None:
        with criu_conf.criu_options("page-server", "port=1234") as watched:
            assert watched == conf and criu_conf.block_env() is None
            inside.set()
            release.wait(5)

    def restore() -> None:
        inside.wait(5)
        with criu_conf.criu_options():
            seen.append(conf.read_text())  # what a CRIU started now would read

    a, b = threading.Thread(target=dump), threading.Thread(target=restore)
    a.start()
    b.start()
    b.join(0.3)
    assert b.is_alive() and conf.read_text() == DEFAULT + "page-server\nport=1234\n"
    release.set()
    a.join(5)
    b.join(5)
    assert seen == [DEFAULT]


def test_a_line_break_in_an_option_is_refused_before_any_file(node: Path) -> None:
    with pytest.raises(UsageError, match="one line"), criu_conf.criu_options("port=1\nlazy-pages"):
        pass
    assert not (node / "runs").exists() or list((node / "runs").iterdir()) == []


def test_a_starting_agent_forgets_the_runs_of_the_one_before(node: Path) -> None:
    criu_conf.CriuRun("left-by-a-dead-agent")
    assert criu_conf.forget_runs() == 2
    assert list((node / "runs").iterdir()) == []


def test_per_run_files_are_used_only_where_the_criu_in_the_path_binds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from podmigrate.runtime import speculative

    for text, expected in ((speculative.criu_gate(), True), ('#!/bin/sh\nexec /usr/sbin/criu "$@"\n', False)):
        d = tmp_path / str(expected)
        d.mkdir()
        (d / "criu").write_text(text)
        (d / "criu").chmod(0o755)
        monkeypatch.setenv("PATH", str(d))
        criu_conf.per_run.cache_clear()
        try:
            assert criu_conf.per_run() is expected
        finally:
            criu_conf.per_run.cache_clear()
