"""Processes that do not run as root migrate here, where root has no CAP_SYS_RESOURCE: podmigrate's
CRIU (``lab/criu_patches/0002-*``) reads their rlimits from /proc when prlimit() is refused (packaged
CRIU fails the dump: "Can't get rlimit 0: Operation not permitted") and restores a hard limit it may
not raise at the one it has, saying so. Shown with Debian's redis-server, run by its image as the
package's ``redis`` user: moved stop-copy (stream) then lazy while one LAN connection sends INCR
after INCR, it keeps the connection and every acknowledged write; and restored under a lower hard
limit than it was dumped with, its limits are clamped, not left as the restorer's."""

from __future__ import annotations

import contextlib
import uuid
from functools import partial
from typing import Any

import pytest

from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import UsageError
from podmigrate.workload import manage, redis

from .conftest import wait_for

pytestmark = pytest.mark.lab


def client_line(lab: Any, host: str, client_id: int) -> str:
    """The server's CLIENT LIST line of the connection with ``client_id``, asked on another connection."""
    listing = str(redis.ask(lab, host, "CLIENT", "LIST"))
    return next((ln for ln in listing.splitlines() if f"id={client_id} " in ln), "")


def acked_past(client: redis.Client, value: int) -> bool:
    return client.acked() >= value


def test_a_non_root_redis_keeps_its_client_connection_and_every_acknowledged_write(lab: Any) -> None:
    name = f"redis-{uuid.uuid4().hex[:6]}"
    ip = redis.start(lab, name, "node-a")
    client: redis.Client | None = None
    try:
        wait_for(lambda: redis.answers(lab, ip), 60, "redis answers PING")
        src = redis.owner(lab, "node-a", name)
        user = lab.run("node-a", ["podman", "inspect", "-f", "{{.Config.User}}", name]).stdout.strip()
        assert user == redis.USER and src["uids"][0] != 0 and src["gids"][0] != 0, (user, src)
        assert len(set(src["uids"])) == 1, src  # real, effective, saved, fs: all the redis user

        client = redis.Client(lab, ip, "acked").start()
        hello = wait_for(lambda: client.last("connected"), 30, "the client's connection")
        wait_for(lambda: client.acked() >= 200, 30, "INCRs acknowledged before the first migration")
        assert f"addr={hello['local']} " in client_line(lab, ip, hello["client_id"])

        for target, mode in (("node-b", "stop-copy"), ("node-a", "lazy")):
            rec = migrate(lab, Plan(workload=name, target=target, mode=mode, transport="stream", probe=redis.PROBE))
            assert rec["status"] == "completed", rec.get("error")
            assert manage.locate(lab, name).node == target
            # the same connection keeps being answered by the copy, and nothing ended it
            wait_for(partial(acked_past, client, client.acked() + 200), 60, f"INCRs acknowledged after {mode}")
            assert client.last("end") is None, client.last("end")
            moved = redis.owner(lab, target, name)
            assert moved["uids"] == src["uids"] and moved["gids"] == src["gids"], (mode, src, moved)

        # the connection the server holds now is the client's first one: same id, same address
        assert f"addr={hello['local']} " in client_line(lab, ip, hello["client_id"])
        end = client.finish()
        assert end["broken"] is None, end
        assert end["wrong"] == [], end  # every reply was the previous one plus one: none lost, none twice
        assert end["client_id"] == hello["client_id"] and end["local"] == hello["local"], (hello, end)
        assert end["acks"] == end["last"] > 400, end  # from 1, each acknowledged once
        assert int(redis.ask(lab, ip, "GET", "acked")) == end["last"], "the server lost an acknowledged write"
    finally:
        if client is not None:
            client.kill()
        with contextlib.suppress(UsageError):
            manage.stop(lab, name)


def core_limit(lab: Any, node: str, pid: int) -> tuple[str, str]:
    """RLIMIT_CORE of ``pid`` on ``node`` as /proc/PID/limits prints it: (soft, hard)."""
    line = next(ln for ln in lab.run(node, ["cat", f"/proc/{pid}/limits"]).stdout.splitlines() if "core file" in ln)
    soft, hard = line.split()[4:6]
    return soft, hard


def may_raise_limits(lab: Any, node: str) -> bool:
    """Whether root on ``node`` (CRIU's restorer) has CAP_SYS_RESOURCE (capability 24)."""
    status = lab.run(node, ["cat", "/proc/self/status"]).stdout
    eff = next(ln for ln in status.splitlines() if ln.startswith("CapEff:"))
    return bool(int(eff.split()[1], 16) & (1 << 24))


def test_a_hard_limit_the_restorer_may_not_raise_is_clamped_and_said(lab: Any) -> None:
    """The restore half of the patch. Restored under a lower hard RLIMIT_CORE (2000) than the dump's
    (unlimited), without CAP_SYS_RESOURCE: the task gets the dumped soft limit (0) under the hard
    limit it may keep, and CRIU's log says so. Packaged CRIU's refused setrlimit() left both as the
    restoring process's (1000, 2000) and said nothing."""
    name = f"redis-{uuid.uuid4().hex[:6]}"
    image = redis.ensure_redis_image(lab)
    node, archive = "node-a", f"/tmp/{name}.tar"
    lab.run(node, ["podman", "run", "-d", "--name", name, "--network", "mig", "--ulimit", "core=0:-1", image])
    try:
        src = redis.owner(lab, node, name)
        assert core_limit(lab, node, src["pid"]) == ("0", "unlimited")
        lab.run(node, ["podman", "container", "checkpoint", "--export", archive, name])
        lab.run(node, ["podman", "rm", "-f", name])
        # the restore (podman, runc, CRIU and so its restorer) runs with a lower hard limit
        lab.run(node, ["prlimit", "--core=1000:2000", "podman", "container", "restore", "--keep", "--import", archive])
        moved = redis.owner(lab, node, name)
        assert moved["uids"] == src["uids"] and moved["uids"][0] != 0, (src, moved)
        static = lab.run(node, ["podman", "inspect", "-f", "{{.StaticDir}}", name]).stdout.strip()
        log = lab.run(node, ["cat", f"{static}/restore.log"]).stdout
        said = [ln for ln in log.splitlines() if "rlimit 4: hard limit" in ln]
        if may_raise_limits(lab, node):  # a host with CAP_SYS_RESOURCE: the dumped limits, as they were
            assert core_limit(lab, node, moved["pid"]) == ("0", "unlimited") and not said, said
        else:
            assert core_limit(lab, node, moved["pid"]) == ("0", "2000")
            assert said and said[0].endswith("refused (no CAP_SYS_RESOURCE), clamped to 2000"), said
    finally:
        lab.run(node, ["podman", "rm", "-f", "-t", "0", name], check=False)
        lab.run(node, ["rm", "-f", archive], check=False)
