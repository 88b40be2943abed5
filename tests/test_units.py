"""Pure logic: blackout from probe logs, errors on the wire, the address plan, small parsers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from podmigrate import layout
from podmigrate.cli import main
from podmigrate.engine.blackout import blackout, counters_monotonic
from podmigrate.engine.controller import parse_probe
from podmigrate.errors import AgentError, PodmigrateError, RuntimeBackendError, TransportError, UsageError
from podmigrate.transport.registry import split_reference

SRC = Path(__file__).resolve().parent.parent / "src"


def probes(pattern: str, t0: float = 100.0, dt: float = 0.02, latency: float = 0.005) -> list[dict[str, Any]]:
    """'++--+' -> probe records: + answered, - failed (after a 1 s timeout)."""
    out = []
    for i, ch in enumerate(pattern):
        sent = t0 + i * dt
        ok = ch == "+"
        out.append({"seq": i, "scheduled": sent, "sent": sent, "ok": ok, "answered": sent + (latency if ok else 1.0)})
    return out


def test_no_failure_means_no_blackout():
    b = blackout(probes("+" * 50), 100.0, 101.0)
    assert b["blackout_s"] == 0.0 and b["failed"] == 0 and b["probes"] == 50


def test_blackout_runs_from_last_success_to_first_success():
    b = blackout(probes("+++-----++"), 100.0, 101.0)
    # last ok before: probe 2 answered at 100.045; first ok after: probe 8 answered at 100.165
    assert b["blackout_s"] == pytest.approx(0.12)
    assert b["failed"] == 5 and not b["unfinished"]


def test_longest_of_several_gaps_is_the_blackout():
    b = blackout(probes("+--+------+-+"), 100.0, 101.0)
    assert b["blackout_s"] == pytest.approx(0.14)
    assert b["failed"] == 9


def test_failure_at_start_counts_from_the_first_probe():
    b = blackout(probes("---++"), 100.0, 101.0)
    assert b["last_ok_before"] is None
    assert b["blackout_s"] == pytest.approx(0.065)


def test_failure_at_end_is_flagged_unfinished():
    b = blackout(probes("++---"), 100.0, 101.0)
    assert b["unfinished"] and b["first_ok_after"] is None
    assert b["blackout_s"] > 0


def test_probes_out_of_order_are_sorted_by_send_time():
    recs = probes("+++-----++")
    b1 = blackout(recs, 100.0, 101.0)
    b2 = blackout(list(reversed(recs)), 100.0, 101.0)
    assert b1 == b2


def test_gaps_outside_the_window_are_ignored():
    b = blackout(probes("+--+" + "+" * 60 + "+"), 100.5, 102.0)
    assert b["blackout_s"] == 0.0


def test_counter_going_backwards_is_detected():
    recs = probes("++++")
    for r, c in zip(recs, [10, 11, 3, 4], strict=True):
        r["counter"] = c
    assert counters_monotonic(recs, recs[2]["sent"] - 0.001)["went_backwards"]
    for r, c in zip(recs, [10, 11, 12, 13], strict=True):
        r["counter"] = c
    assert not counters_monotonic(recs, recs[2]["sent"] - 0.001)["went_backwards"]


def test_errors_survive_the_wire_with_their_class_and_hint():
    e = RuntimeBackendError("criu failed", hint="read the log", details={"criu_log": ["Error (x)"]})
    back = PodmigrateError.from_wire(e.to_wire())
    assert isinstance(back, RuntimeBackendError)
    assert back.hint == "read the log" and back.details["criu_log"] == ["Error (x)"]
    assert "hint: read the log" in str(back)


def test_unknown_error_kind_becomes_the_base_class():
    assert type(PodmigrateError.from_wire({"kind": "Nope", "message": "m"})) is PodmigrateError


def test_address_plan():
    assert layout.node_names(3) == ["node-a", "node-b", "node-c"]
    assert layout.node_ip("node-b") == "10.77.0.12"
    assert layout.node_range("node-c") == "10.89.3.0/24"
    assert layout.in_workload_subnet("10.89.2.7") and not layout.in_workload_subnet("10.88.0.2")
    with pytest.raises(ValueError):
        layout.node_names(0)
    with pytest.raises(ValueError):
        layout.node_index("nodeA")


def test_image_references_need_a_tag():
    assert split_reference("10.77.0.1:5000/podmigrate/ckpt:abc") == ("10.77.0.1:5000", "podmigrate/ckpt", "abc")
    with pytest.raises(TransportError):
        split_reference("10.77.0.1:5000/podmigrate/ckpt")


def test_probe_specs():
    assert parse_probe("http:8000/healthz") == (8000, "/healthz")
    assert parse_probe("tcp:5432") == (5432, None)
    for bad in ("udp:1", "http:x/y", "tcp:0", "tcp:80/x", "8000"):
        with pytest.raises(UsageError):
            parse_probe(bad)


def test_code_that_runs_inside_the_lab_needs_only_the_standard_library_and_the_node_images_cryptography():
    from podmigrate.lab.image import PACKAGES

    assert "python3-cryptography" in PACKAGES  # what transport.seal needs on the nodes
    modules = [
        "podmigrate.agent.server",
        "podmigrate.lab.init",
        "podmigrate.transport.registry",
        "podmigrate.routing.route",
        "podmigrate.runtime.podman",
        "podmigrate.errors",
    ]
    # every module loaded must come from the standard library, podmigrate, or cryptography (and what
    # cryptography itself loads); anything else would be missing on the node image
    code = (
        f"import sys, sysconfig; before = set(sys.modules); sys.path.insert(0, {str(SRC)!r}); "
        + "; ".join(f"import {m}" for m in modules)
        + "; std = sysconfig.get_paths()['stdlib']"
        + "; bad = sorted(n for n, m in list(sys.modules.items()) if n not in before and getattr(m, '__file__', None)"
        " and not m.__file__.startswith((std, " + repr(str(SRC)) + "))"
        " and n.split('.')[0] not in ('cryptography', '_cffi_backend', 'cffi', 'typing_extensions'))"
        + "; print(bad); sys.exit(1 if bad else 0)"
    )
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_cli_lists_its_commands():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for cmd in ("lab", "workload", "migrate"):
        assert cmd in res.output


def test_the_lab_never_imports_the_workload():
    # the workload's image is built on a lab by whoever needs it; the lab building it was a cycle
    for f in (SRC / "podmigrate" / "lab").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            assert not [n for n in names if n.startswith("podmigrate.workload")], f"{f.name}:{node.lineno}"


def test_the_workload_image_is_looked_up_once_per_running_lab(tmp_path):
    from podmigrate.workload import image

    class FakeLab:
        dir = cache = tmp_path
        pid = 1
        asked: list[str] = []

        def holder_pid(self) -> int:
            return self.pid

        def run(self, target: str, argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
            self.asked.append(argv[0])
            return subprocess.CompletedProcess(argv, 0, "", "")  # the registry has it

    lab: Any = FakeLab()
    assert image.ensure_workload_image(lab) == image.ensure_workload_image(lab) == image.workload_image()
    assert lab.asked == ["skopeo"]
    lab.pid = 2  # the lab went down and up again: its registry is new
    image.ensure_workload_image(lab)
    assert lab.asked == ["skopeo", "skopeo"]


def test_a_success_slower_than_the_timeout_counts_as_failed():
    recs = probes("+-+--+")
    recs[2]["answered"] = recs[2]["sent"] + 1.004  # got through on a SYN retransmit
    b = blackout(recs, 100.0, 101.0)
    assert b["failed"] == 4
    # from the first answer (100.005) to the last probe's answer (100.105)
    assert b["blackout_s"] == pytest.approx(0.1)


def test_a_slow_answer_before_the_run_does_not_shrink_it():
    recs = probes("++---+")
    recs[1]["answered"] = recs[1]["sent"] + 0.5  # slow, but within the timeout
    b = blackout(recs, 100.0, 101.0)
    # up until the first failure was sent (100.04), back at the answer of probe 5 (100.105)
    assert b["blackout_s"] == pytest.approx(0.065)


@pytest.mark.parametrize("name", ["web", "web-", "a..b", "Web_App", "-x", "x__y", "a" * 200, "名前", "db.1"])
def test_any_container_name_makes_a_valid_distinct_repository(name):
    from podmigrate.transport.registry import _COMPONENT, repository_component

    got = repository_component(name)
    assert _COMPONENT.match(got) and len(got) <= 128, got
    others = {repository_component(n) for n in ("web", "web-", "web--", "Web")}
    assert len(others) == 4  # names that clean to the same text stay apart


def test_the_agents_per_checkpoint_locks_do_not_grow_without_bound(tmp_path):
    from podmigrate.agent.checkpoints import MAX_LOCKS, CheckpointDir

    d = CheckpointDir(tmp_path)
    held = d.busy("held")
    with held:
        for i in range(3 * MAX_LOCKS):
            with d.busy(f"m{i}"):
                pass
        assert len(d._locks) <= MAX_LOCKS + 2 and d.busy("held") is held  # a held lock is never dropped


def test_a_held_connection_to_a_peer_that_vanished_stops_at_once():
    """A peer that stops answering without a FIN (a retired source is cut off so) must not keep
    closing the connection waiting for TCP_USER_TIMEOUT."""
    import socket
    import threading
    import time

    from podmigrate.agent.probe import KeepAlive

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    accepted: list[socket.socket] = []

    def serve() -> None:  # answers the first request, then reads and never answers again
        c, _ = srv.accept()
        accepted.append(c)
        c.recv(4096)
        body = b'{"counter": 1}'
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        c.recv(4096)

    threading.Thread(target=serve, daemon=True).start()
    held = KeepAlive("127.0.0.1", port, interval=0.05)
    deadline = time.monotonic() + 10
    while held.requests < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    st = held.stop()
    assert time.monotonic() - t0 < 6 and st["requests"] >= 1
    srv.close()


def test_the_engine_bench_sets_security_on_beside_off_per_heap_and_method() -> None:
    from podmigrate.bench.engine import security_cost, table

    def row(method: str, blackout: float, warmup: bool = False) -> dict[str, Any]:
        return {"heap_mb": 1024, "method": method, "warmup": warmup, "blackout_s": blackout, "phase_s": {},
                "state": "kept", "sha256_equal": True}  # fmt: skip

    rows = [row("lazy · security on", b) for b in (0.5, 0.6, 0.55)] + [
        row("lazy · security off", b) for b in (0.5, 0.45, 0.4)
    ]
    rows.append(row("lazy · security on", 9.0, warmup=True))  # warm-ups never count
    assert security_cost(table(rows)) == [
        {"heap_mb": 1024, "method": "lazy", "n": 3, "blackout_on_s": 0.55, "blackout_off_s": 0.45,
         "ratio": 1.222, "checkpoint_on_s": None, "checkpoint_off_s": None}
    ]  # fmt: skip
    assert security_cost(table([row("lazy", 0.5)])) == []


def test_a_probe_stopped_without_waiting_reports_its_unanswered_probes_as_pending() -> None:
    import socket
    import time

    from podmigrate.agent.probe import Probe

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        pr = Probe("127.0.0.1", silent.getsockname()[1], "/healthz", interval=0.02, timeout=5.0)
        deadline = time.monotonic() + 10
        while len(pr._inflight) < 3:
            assert time.monotonic() < deadline, "no probe went out"
            time.sleep(0.01)
        t0 = time.monotonic()
        log = pr.stop(wait=False)
        assert time.monotonic() - t0 < 1.0  # not the probes' 5 s timeout
    assert log and all(r.get("pending") and not r["ok"] and "answered" not in r for r in log)
    assert [r["seq"] for r in log] == sorted(r["seq"] for r in log)


def test_probes_in_flight_at_the_stop_count_as_failed_before_the_service_is_back_and_are_dropped_after() -> None:
    from podmigrate.engine.blackout import blackout
    from podmigrate.engine.phases.traffic import settle_pending

    cut = 10.0

    def r(sent: float, ok: bool, pending: bool = False) -> dict[str, object]:
        out: dict[str, object] = {"sent": sent, "scheduled": sent, "ok": ok}
        return {**out, "pending": True} if pending else {**out, "answered": sent + 0.01}

    log = [
        r(9.0, True),
        r(9.5, False, pending=True),
        r(9.8, False),
        r(10.2, True),
        r(10.3, True),
        r(10.4, False, pending=True),
    ]
    settled, n = settle_pending(log, cut)
    assert n == 2 and [x["sent"] for x in settled] == [9.0, 9.5, 9.8, 10.2, 10.3]
    assert settled[1]["ok"] is False and settled[1]["error"] == "no answer when the probe stopped"
    b = blackout(settled, 9.4, 11.0)
    assert b["failed"] == 2 and b["blackout_s"] == round(10.21 - 9.01, 4)
    # with no answer after the switch yet, every pending probe is a failure
    assert len(settle_pending([r(9.0, True), r(10.1, False, pending=True)], cut)[0]) == 2


class _Target:
    """A target agent's lazy route answering from a script of daemon states."""

    def __init__(self, states: list[dict[str, Any]], collapse: Exception | None = None):
        self.states, self.asked, self.posted, self.collapse = states, 0, list[str](), collapse
        self.bodies: list[Any] = []

    def get(self, path: str) -> dict[str, Any]:
        assert path == "/v1/checkpoints/m1/lazy"
        state = self.states[min(self.asked, len(self.states) - 1)]
        self.asked += 1
        return state

    def post(self, path: str, body: Any = None) -> dict[str, Any]:
        self.posted.append(path)
        self.bodies.append(body)
        if self.collapse:
            raise self.collapse
        return {"collapsed_bytes": 1 << 30, "failed": {}}


def _pages_ctx(target: _Target, lazy_local: bool = True) -> Any:
    from types import SimpleNamespace

    rec = {"id": "m1", "target": "node-b", "container": "web", "lazy_local": lazy_local}
    return SimpleNamespace(rec=rec, agent=lambda node: target)


def test_a_streamed_restore_waits_for_its_local_daemon_and_fails_if_it_failed() -> None:
    from podmigrate.engine.phases.lazy import local_pages

    running, done = {"dst": {"running": True, "rc": None}}, {"dst": {"running": False, "rc": 0}}
    target = _Target([running, running, done])
    ctx = _pages_ctx(target)
    local_pages(ctx)
    assert target.asked == 3 and ctx.rec["local_pages"]["daemon_rc"] == 0
    # once the last page is in, and only then, the copy's memory goes back into huge pages
    assert target.posted == ["/v1/containers/web/huge-pages"] and ctx.rec["huge_pages"]["collapsed_bytes"] == 1 << 30
    # in the target agent's background: the migration does not wait for it
    assert target.bodies == [{"background": True}]
    # the copy serves whatever the collapse did: its failure is recorded, not rolled back
    broken = _pages_ctx(_Target([done], collapse=AgentError("agent node-b: no such route")))
    local_pages(broken)
    assert broken.rec["local_pages"]["daemon_rc"] == 0 and "no such route" in broken.rec["huge_pages"]["error"]
    failed = _Target([{"dst": {"running": False, "rc": 1}}])
    with pytest.raises(PodmigrateError, match=r"failed \(exit 1\): the copy may miss pages"):
        local_pages(_pages_ctx(failed))
    assert failed.posted == []
    eager = _Target([running])
    local_pages(_pages_ctx(eager, lazy_local=False))  # an eager restore: nothing to wait for
    assert eager.asked == 0
    # an agent that has no record of the daemon (restarted) is not taken for one that finished
    with pytest.raises(PodmigrateError, match="no record of the lazy-pages daemon"):
        local_pages(_pages_ctx(_Target([{"lan_tx_bytes": 0}])))


def test_the_pages_phase_waits_out_a_target_agent_that_is_briefly_unreachable(monkeypatch: Any) -> None:
    from podmigrate.engine.phases import lazy

    class Flaky(_Target):
        def get(self, path: str) -> dict[str, Any]:
            self.asked += 1
            if self.asked <= 2:
                raise AgentError("agent node-b unreachable")
            return {"dst": {"running": False, "rc": 0}}

    monkeypatch.setattr(lazy, "_pause", lambda s: None)
    flaky = Flaky([])
    ctx = _pages_ctx(flaky)
    lazy.local_pages(ctx)
    assert flaky.asked == 3 and ctx.rec["local_pages"]["daemon_rc"] == 0
    monkeypatch.setattr(lazy, "AGENT_PATIENCE_S", -1.0)  # gone for good: the phase fails, and rolls back
    with pytest.raises(AgentError):
        lazy.local_pages(_pages_ctx(Flaky([])))


def test_the_engine_bench_says_what_the_guest_memory_warm_up_changed() -> None:
    from podmigrate.bench import memory

    def row(method: str, heap: int, blackout: float | None, warmup: bool) -> dict[str, Any]:
        return {"method": method, "heap_mb": heap, "blackout_s": blackout, "warmup": warmup}

    rows = [
        row(memory.BEFORE, 1024, 6.0, True),
        row(memory.BEFORE, 1024, 4.0, True),
        row("warm-up stop-copy/stream", 64, 0.9, True),  # another heap: not compared
        row("warm-up stop-copy/stream", 1024, 2.5, True),
        row("warm-up stop-copy/stream", 1024, 2.5, True),
        *(row("stop-copy/stream", 1024, b, False) for b in (2.0, 2.2, 2.1)),
        row("lazy (post-copy)", 1024, 0.5, False),
    ]
    e = memory.effect(rows, 1024)
    assert e == {
        "heap_mb": 1024,
        "before_s": [6.0, 4.0],
        "after_s": [2.5, 2.5],
        "before_over_after": 2.0,
        "median_after_s": 2.1,
    }
    text = memory.describe(e)
    assert "6.0, 4.0 s before it" in text and "2.5, 2.5 s after it" in text and "before/after 2.0" in text
    # without the pair before warming (the warm-up was off), nothing is claimed
    assert memory.effect([r for r in rows if r["method"] != memory.BEFORE], 1024) is None


def test_the_probe_lead_before_the_freeze_ends_at_its_second_answer() -> None:
    """start_probe waits for two answered probes (so that "last success before" exists), polling the
    observer, and no longer; a service that never answers is not waited for past PROBE_LEAD_S."""
    from podmigrate.engine.phases import traffic

    class CountingObserver:
        def __init__(self, answers: list[list[dict[str, Any]]]):
            self.answers, self.reads, self.started = answers, 0, 0

        def start_probe(self, probe: dict[str, Any]) -> str:
            self.started += 1
            return "p1"

        def probe_records(self, probe_id: str) -> list[dict[str, Any]]:
            self.reads += 1
            return self.answers[min(self.reads, len(self.answers)) - 1]

    class Ctx:
        def __init__(self, obs: CountingObserver):
            self.rec: dict[str, Any] = {"probe": {"host": "10.0.0.1", "port": 8000}}
            self._obs = obs

        def observer(self) -> CountingObserver:
            return self._obs

    ok, failed = {"ok": True}, {"ok": False}
    answering = CountingObserver([[], [ok], [ok, failed], [ok, failed, ok], [ok, ok, ok, ok]])
    ctx = Ctx(answering)
    traffic.start_probe(ctx)  # type: ignore[arg-type]
    assert answering.reads == 4 and ctx.rec["probe"]["id"] == "p1"
    traffic.start_probe(ctx)  # type: ignore[arg-type]
    assert answering.started == 1  # a probe that runs already is not started again
    silent = CountingObserver([[failed]])
    traffic.start_probe(Ctx(silent))  # type: ignore[arg-type]
    assert 1 < silent.reads < 100  # polled until the lead's end, then the migration goes on
