"""A streamed migration's node pieces without a cluster: the waiting restore in the RuntimeClass's
runtime (a stand-in criu page server, named so) and the agents' sealed channels on loopback."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from podmigrate.errors import RuntimeBackendError, TransportError, UsageError
from podmigrate.k8s import streams as streams_mod
from podmigrate.k8s.restores import VERIFIED, Restores
from podmigrate.k8s.streams import Streams, container_pids
from podmigrate.polling import poll
from podmigrate.transport import seal
from podmigrate.transport.pagerelay import SourceRelay

from .test_restore_paths import CTR

# a stand-in for `criu page-server -D DIR --port P ...`: takes one connection, keeps what it sent;
# and for `criu lazy-pages ... -W WORK`: says it is ready (its socket) and ends (fails, with a file
# `no-lazy` beside it)
FAKE_CRIU = r"""#!{python}
import pathlib, socket, sys
args = sys.argv[1:]
if args[0] == "lazy-pages":
    if pathlib.Path(sys.argv[0]).with_name("no-lazy").exists():
        sys.exit(1)
    pathlib.Path(args[args.index("-W") + 1], "lazy-pages.socket").touch()
    sys.exit(0)
images, port = args[args.index("-D") + 1], int(args[args.index("--port") + 1])
srv = socket.create_server(("127.0.0.1", port))
conn, _ = srv.accept()
with open(images + "/pages-1.img", "wb") as f:
    while chunk := conn.recv(65536):
        f.write(chunk)
"""


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    restore, state = tmp_path / "restore", tmp_path / "state"
    (tmp_path / "bundle" / "rootfs").mkdir(parents=True)
    restore.mkdir()
    runc, criu = tmp_path / "runc", tmp_path / "criu"
    runc.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/runc.argv\n')
    criu.write_text(FAKE_CRIU.format(python=sys.executable))
    for f in (runc, criu):
        f.chmod(0o755)
    conf = tmp_path / "conf.json"
    conf.write_text(
        json.dumps({"runc": str(runc), "criu": str(criu), "state": str(state), "restore_dir": str(restore)})
    )
    return {"tmp": tmp_path, "restore": restore, "conf": conf, "bundle": tmp_path / "bundle"}


def waiting_create(node: dict[str, Path], src: Path, wait: str = "60", lazy: bool = False) -> subprocess.Popen[str]:
    ann = {**CTR, "io.podmigrate.restore": "server", "io.podmigrate.stream": "server",
           "io.podmigrate.restore-from.server": str(src), "io.podmigrate.wait-seconds": wait}  # fmt: skip
    if lazy:
        ann["io.podmigrate.lazy"] = "server"
    (node["bundle"] / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "annotations": ann}))
    script = (
        "import sys, pathlib; import podmigrate.runtime.runc_restore as r; "
        f"r.CONFIG = pathlib.Path({str(node['conf'])!r}); sys.exit(r.main(sys.argv[1:]))"
    )
    argv = [sys.executable, "-c", script, "--log", str(node["tmp"] / "log.json"), "create", "--bundle",
            str(node["bundle"]), "--pid-file", "p", "cid"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_streamed_copy_serves_its_pages_waits_for_the_rest_and_then_restores(node):
    src = node["restore"] / "m1" / "server"
    (src / "checkpoint").mkdir(parents=True)
    create = waiting_create(node, src)
    port = poll(lambda: json.loads((src / "page-server.json").read_text())["port"]
                if (src / "page-server.json").exists() else None, 30, "the page server's port")  # fmt: skip
    assert oct((src / "page-server.json").stat().st_mode & 0o777) == "0o600"
    pages = os.urandom(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(pages)
    assert create.poll() is None  # pages alone are not a checkpoint: it waits for the agent's word
    (src / "checkpoint" / "descriptors.json").write_text("[]")
    (src / VERIFIED).write_text("{}")
    assert create.wait(30) == 0, create.stderr.read() if create.stderr else ""
    assert (src / "checkpoint" / "pages-1.img").read_bytes() == pages
    argv = (node["tmp"] / "runc.argv").read_text().split()
    assert argv[2:5] == ["restore", "--detach", "--no-subreaper"] and f"{src}/checkpoint" in argv
    # the memory stays in the images: a local daemon copies it in behind the running copy
    assert "--lazy-pages" in argv and "--auto-dedup" not in argv
    assert (src / "lazy-daemon.pid").read_text().isdigit()
    # its checkpoint deleted after the migration, the container restarted: fresh, never a failure
    shutil.rmtree(src)
    assert waiting_create(node, src).wait(30) == 0
    assert (node["tmp"] / "runc.argv").read_text().splitlines()[-1].split()[2] == "create"


def test_a_streamed_copy_whose_local_daemon_does_not_start_reads_its_pages_at_once(node):
    (node["tmp"] / "no-lazy").touch()
    src = node["restore"] / "m1" / "server"
    (src / "checkpoint").mkdir(parents=True)
    create = waiting_create(node, src)
    port = poll(lambda: json.loads((src / "page-server.json").read_text())["port"]
                if (src / "page-server.json").exists() else None, 30, "the page server's port")  # fmt: skip
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"p" * 4096)
    (src / "checkpoint" / "descriptors.json").write_text("[]")
    (src / VERIFIED).write_text("{}")
    assert create.wait(30) == 0, create.stderr.read() if create.stderr else ""
    argv = (node["tmp"] / "runc.argv").read_text().split()
    assert "--auto-dedup" in argv and "--lazy-pages" not in argv and not (src / "lazy-daemon.pid").exists()


def test_the_pages_phase_waits_for_the_local_daemon_and_reports_its_failure(tmp_path):
    streams = Streams(Restores(tmp_path / "r", tmp_path / "r"), "127.0.0.1")
    streams.prepare("m1", ["server"])
    d = tmp_path / "r" / "m1" / "server"
    body = {"checkpoint_id": "m1", "container": "server", "timeout": 30}
    assert streams.lazy.pages_in(body) == {"lazy": False, "seconds": 0.0}  # restored eagerly: nothing to wait for
    # a stand-in daemon (named so in its argv, as the agent checks: pids are reused)
    done = tmp_path / "last-page"
    script = "import pathlib, sys, time; time.sleep(0.5); pathlib.Path(sys.argv[1]).touch()"
    daemon = subprocess.Popen([sys.executable, "-c", script, str(done), "lazy-pages"])
    (d / "lazy-daemon.pid").write_text(str(daemon.pid))
    threading.Thread(target=daemon.wait, daemon=True).start()  # reaped as the shim reaps it
    out = streams.lazy.pages_in(body)
    assert out["lazy"] and done.exists() and out["seconds"] > 0  # it returned once the daemon had ended
    (d / "lazy-pages.log").write_text("(00.1) Error (criu/uffd.c:1): uffd: copy failed\n")
    with pytest.raises(RuntimeBackendError, match=r"lazy-pages daemon of server.s copy failed: .*copy failed"):
        streams.lazy.pages_in(body)
    # a pid that now names another process is not the daemon
    (d / "lazy-pages.log").unlink()
    (d / "lazy-daemon.pid").write_text(str(os.getpid()))
    assert streams.lazy.pages_in(body)["lazy"]


def test_the_sandbox_of_a_restored_pod_is_created_by_plain_runc(node):
    """The pause container gets the pod's annotations too; it has no container name."""
    (node["bundle"] / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "annotations": {
        "io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": "sb1",
        "io.podmigrate.restore": "server"}}))  # fmt: skip
    script = (
        "import sys, pathlib; import podmigrate.runtime.runc_restore as r; "
        f"r.CONFIG = pathlib.Path({str(node['conf'])!r}); sys.exit(r.main(sys.argv[1:]))"
    )
    p = subprocess.run([sys.executable, "-c", script, "create", "--bundle", str(node["bundle"]), "sb1"],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert (node["tmp"] / "runc.argv").read_text().split()[0] == "create"


def test_a_lazy_copy_waits_without_a_page_server_and_restores_with_its_daemon(node):
    src = node["restore"] / "m1" / "server"
    (src / "checkpoint").mkdir(parents=True)
    create = waiting_create(node, src, lazy=True)
    got = poll(lambda: json.loads((src / "page-server.json").read_text())
               if (src / "page-server.json").exists() else None, 30, "the copy waiting")  # fmt: skip
    # the pages stay with the source until asked for; no network namespace in its spec, no address said
    assert got == {"port": None, "lazy": True, "pod_ip": None}
    (src / "lazy.json").write_text(json.dumps({"port": 1}))
    (src / "checkpoint" / "descriptors.json").write_text("[]")
    (src / VERIFIED).write_text("{}")
    assert create.wait(30) == 0, create.stderr.read() if create.stderr else ""
    assert (src / "lazy-daemon.pid").read_text().isdigit()  # for the agent's fault waker
    argv = (node["tmp"] / "runc.argv").read_text().split()
    assert argv[2] == "restore" and "--lazy-pages" in argv and "--auto-dedup" not in argv


def test_an_aborted_streamed_restore_fails_at_once_and_never_starts_fresh(node):
    src = node["restore"] / "m1" / "server"
    (src / "checkpoint").mkdir(parents=True)
    create = waiting_create(node, src)
    poll(lambda: (src / "page-server.json").exists() or None, 30, "the page server")
    (src / "abort").touch()
    assert create.wait(30) == 1
    assert "the migration was rolled back" in (node["tmp"] / "log.json").read_text()
    assert not (node["tmp"] / "runc.argv").exists()  # neither restored nor created fresh


def test_a_streamed_restore_outside_the_restore_directory_is_refused(node):
    create = waiting_create(node, node["tmp"])
    assert create.wait(30) == 1
    assert "needs io.podmigrate.restore-from.server naming a directory" in (node["tmp"] / "log.json").read_text()


class FakePageServer:
    """Stands in for the page server the waiting create starts: keeps what arrives."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.got = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            while chunk := conn.recv(65536):
                self.got += chunk


def rest_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in (("checkpoint/descriptors.json", b"[]"), ("checkpoint/core-1.img", b"core")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def send_pages(key: str, port: int, data: bytes) -> None:
    relay = SourceRelay("m1.server", key, ("127.0.0.1", port))
    with socket.create_connection(("127.0.0.1", relay.port)) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    relay.wait(30)


def target(tmp_path: Path) -> tuple[Streams, dict[str, Any], FakePageServer, str]:
    streams = Streams(Restores(tmp_path / "r", tmp_path / "r"), "127.0.0.1")
    streams.prepare("m1", ["server"])
    server = FakePageServer()
    (tmp_path / "r" / "m1" / "server" / "page-server.json").write_text(json.dumps({"port": server.port}))
    key = seal.new_key()
    ports = streams.listen({"checkpoint_id": "m1", "container": "server", "seal": key, "peer": "127.0.0.1"})
    return streams, ports, server, key


def test_pages_and_the_rest_cross_sealed_and_the_target_verifies_them(tmp_path):
    streams, ports, server, key = target(tmp_path)
    pages = os.urandom(3 << 20)
    send_pages(key, ports["pages_port"], pages)
    Streams._send("m1", "server", key, "127.0.0.1", ports["rest_port"], lambda f: f.write(rest_tar()))
    out = streams.verify("m1", "server")
    server.thread.join(10)
    assert hashlib.sha256(server.got).hexdigest() == hashlib.sha256(pages).hexdigest()
    d = tmp_path / "r" / "m1" / "server"
    assert out["path"] == str(d) and out["pages_bytes"]["pages"] == len(pages)
    assert (d / "checkpoint" / "core-1.img").read_bytes() == b"core" and (d / VERIFIED).exists()
    assert not (d / "rest.tar").exists()
    assert {oct(p.stat().st_mode & 0o777) for p in d.rglob("*") if p.is_file()} == {"0o600"}


def test_a_stream_sealed_with_another_key_is_refused_and_the_waiting_copy_told(tmp_path, monkeypatch):
    monkeypatch.setattr(streams_mod, "VERIFY_S", 2.0)
    streams, ports, _server, _key = target(tmp_path)
    send_pages(seal.new_key(), ports["pages_port"], b"x" * 1000)  # a stranger's: dropped at its first frame
    with pytest.raises(TransportError, match="did not all arrive"):
        streams.verify("m1", "server")
    assert (tmp_path / "r" / "m1" / "server" / "abort").exists()
    assert not (tmp_path / "r" / "m1" / "server" / VERIFIED).exists()


def test_listening_for_an_aborted_migration_stops_at_once(tmp_path):
    streams = Streams(Restores(tmp_path / "r", tmp_path / "r"), "127.0.0.1")
    streams.prepare("m1", ["server"])
    streams.abort("m1")
    with pytest.raises(UsageError, match="aborted"):
        streams.listen({"checkpoint_id": "m1", "container": "server", "seal": seal.new_key(), "timeout": 30})


def test_a_container_is_found_by_its_cgroup_and_its_shim_by_its_parent(tmp_path):
    cid = "ab" * 32

    def proc(pid: int, ppid: int, cgroup: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\n")

    proc(10, 1, "/node-a/k8s.io")  # the shim
    proc(11, 10, f"/node-a/k8s.io/{cid}")  # the container's first process
    proc(12, 11, f"/node-a/k8s.io/{cid}")  # a child of it
    proc(13, 1, f"/node-b/k8s.io/{'cd' * 32}")  # another container
    assert container_pids(cid, tmp_path) == (11, 10)
    with pytest.raises(RuntimeBackendError, match="hostPID"):
        container_pids("ef" * 32, tmp_path)
    with pytest.raises(UsageError):
        container_pids("../../etc", tmp_path)


def test_a_memory_reservation_stays_inside_the_agents_own_limit(tmp_path):
    from podmigrate.agent.memory import _cgroup_room

    assert _cgroup_room(tmp_path) > 1 << 50  # no memory controller here: no bound from the cgroup
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert _cgroup_room(tmp_path) > 1 << 50
    (tmp_path / "memory.max").write_text(str(512 << 20))
    (tmp_path / "memory.current").write_text(str(100 << 20))
    assert _cgroup_room(tmp_path) == (512 - 100 - 64) << 20
