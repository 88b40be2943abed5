"""Two CRIU runs with options of their own on one real node at once (``runtime.criu_conf``): podman,
runc and CRIU as a migration runs them, each checkpoint's file named by its container's ID. The
first run's CRIU is held inside its dump (an action script of its own options) until the second
one's dump has finished: with one node-wide configuration, or runs taking turns, the second could
not finish first, or would run the first one's script."""

from __future__ import annotations

from typing import Any

import pytest

from podmigrate.runtime.criu_conf import CRIU_RUNS

pytestmark = pytest.mark.lab

SCRIPT = r"""
set -eu
runs=$(mktemp -d /run/podmigrate-test-criu.XXXXXX)
first_conf=@RUNS@/id-$(podman inspect -f '{{.ID}}' -- "$1").conf
second_conf=@RUNS@/id-$(podman inspect -f '{{.ID}}' -- "$2").conf
mkdir -p @RUNS@
trap 'rm -rf "$runs" "$first_conf" "$second_conf"' EXIT
cat > "$runs/hold.sh" <<EOS
#!/bin/sh
echo "\$CRTOOLS_SCRIPT_ACTION" >> $runs/actions
if [ "\$CRTOOLS_SCRIPT_ACTION" = pre-dump ]; then
  touch $runs/held
  i=0
  while [ ! -e $runs/second-done ] && [ \$i -lt 600 ]; do sleep 0.05; i=\$((i+1)); done
  [ -e $runs/second-done ]
fi
EOS
chmod 700 "$runs/hold.sh"
{ cat /etc/criu/runc.conf; echo "action-script=$runs/hold.sh"; } > "$first_conf"
cat /etc/criu/runc.conf > "$second_conf"
before=$(sha256sum /etc/criu/runc.conf)
podman container checkpoint --leave-running -- "$1" > "$runs/first.out" 2>&1 &
first=$!
i=0
while [ ! -e "$runs/held" ]; do
  kill -0 $first 2>/dev/null || { echo "first dump ended before its script ran:"; cat "$runs/first.out"; exit 3; }
  [ $i -lt 1200 ] || { echo "first dump never reached its script"; exit 4; }
  sleep 0.05; i=$((i+1))
done
podman container checkpoint --leave-running -- "$2"
echo "second done while the first was held"
touch "$runs/second-done"
wait $first && echo "first done"
echo "pre-dump scripts run: $(grep -c '^pre-dump$' "$runs/actions")"
[ "$before" = "$(sha256sum /etc/criu/runc.conf)" ] && echo "node runc.conf untouched"
""".replace("@RUNS@", str(CRIU_RUNS))


def test_two_dumps_on_one_node_run_at_once_each_with_its_own_options(lab: Any, workload: Any) -> None:
    a, b = workload("node-a", 16), workload("node-a", 16)
    p = lab.run("node-a", ["sh", "-c", SCRIPT, "sh", a["name"], b["name"]], check=False, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    lines = p.stdout.splitlines()
    # the second dump ended while the first one's CRIU waited inside its own script, then the first
    assert lines.index("second done while the first was held") < lines.index("first done"), out
    # the first CRIU ran its script; the second never did (it would have waited for itself)
    assert "pre-dump scripts run: 1" in lines, out
    assert "node runc.conf untouched" in lines, out


def test_a_container_in_a_lazy_dump_is_listed_without_waiting_for_its_dump(lab: Any, workload: Any) -> None:
    """podman's ps and inspect wait for a container's lock, which a lazy dump holds until the last
    page has moved; the agent lists that container as it saw it, ``checkpointing``, and the others
    as podman does. Here no target ever pulls: the dump would hold the lock for good."""
    import uuid

    from podmigrate.workload import manage

    from .conftest import wait_for

    dumped, other = workload("node-a", 16), workload("node-a", 16)
    agent = lab.agent("node-a", timeout=60)
    cid = f"t{uuid.uuid4().hex[:12]}"
    body = {"checkpoint_id": cid, "tcp_established": True, "criu_tls": False}
    res = agent.post(f"/v1/containers/{dumped['name']}/checkpoint-lazy", body)
    try:
        listed = {c["name"]: c for c in agent.get("/v1/containers", timeout=30)}
        assert listed[dumped["name"]]["state"] == "checkpointing"
        assert listed[dumped["name"]]["ips"] == [dumped["ip"]]
        assert listed[other["name"]]["state"] == "running"
    finally:
        agent.post(f"/v1/checkpoints/{cid}/abort-lazy", {"port": res["port"]})
        agent.post(f"/v1/containers/{dumped['name']}/resume")
        agent.delete(f"/v1/checkpoints/{cid}")
    # the dump given up, podman's own view again, and the container serves with its heap
    wait_for(
        lambda: {c["name"]: c["state"] for c in agent.get("/v1/containers")}[dumped["name"]] == "running",
        30,
        "the container listed as running again",
    )
    assert manage.state(lab, dumped["name"])["sha256"] == dumped["sha256"]
    agent.close()
