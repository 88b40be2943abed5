"""Waiting for kube-proxy to follow an EndpointSlice change (``k8s.proxies``), against a stand-in for
its /healthz (named so) on loopback: a mark on the proxy's own clock, then a later write."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

from podmigrate.k8s import proxies


class FakeProxyHealthz:
    """kube-proxy's /healthz as upstream writes it; ``sync()`` makes it write its rules now."""

    def __init__(self, skew: timedelta) -> None:
        self.skew = skew  # its clock against ours: the mark must come from its clock, not ours
        self.written = self.now() - timedelta(seconds=30)
        self.queued = False  # a change it has received and not written yet
        owner = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                stamp = owner.now()
                top = owner.written if owner.queued else stamp
                body = json.dumps({"lastUpdated": _go(top), "currentTime": _go(stamp),
                                   "status": {"IPv4": {"lastUpdated": _go(owner.written)}}}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def now(self) -> datetime:
        return datetime.now(UTC) + self.skew

    def sync(self) -> None:
        self.written, self.queued = self.now(), False


def _go(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"  # nanoseconds, as Go writes them


def ctx(events: list[str]) -> Any:
    node = {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}}
    api = SimpleNamespace(list=lambda path, **kw: [node])
    config = SimpleNamespace(blackout_poll_s=0.01, drain_s=0.05, proxy_min_sync_s=0.5)
    return SimpleNamespace(api=api, config=config, event=lambda kind, reason, msg: events.append(reason))


@pytest.mark.parametrize("skew", [timedelta(hours=-1), timedelta(hours=1)])
def test_it_returns_once_the_proxy_wrote_its_rules_after_the_mark_on_its_own_clock(monkeypatch, skew):
    fake = FakeProxyHealthz(skew)
    monkeypatch.setattr(proxies, "HEALTHZ_PORT", fake.port)
    events: list[str] = []
    marks = proxies.mark(ctx(events))
    fake.queued = True  # the EndpointSlice change reached it
    threading.Timer(0.3, fake.sync).start()
    got = proxies.follow(ctx(events), marks, timeout=5)
    assert got["proxies"] == 1 and got["behind"] == [] and got["seconds"] >= 0.25
    assert events == []
    fake.server.shutdown()


def test_a_proxy_that_never_syncs_is_reported_and_none_at_all_gets_a_fixed_wait(monkeypatch):
    fake = FakeProxyHealthz(timedelta(0))
    monkeypatch.setattr(proxies, "HEALTHZ_PORT", fake.port)
    events: list[str] = []
    marks = proxies.mark(ctx(events))
    fake.queued = True
    got = proxies.follow(ctx(events), marks, timeout=0.3)
    assert got["behind"] == ["127.0.0.1"] and events == ["ProxiesBehind"]
    fake.server.shutdown()
    assert proxies.mark(ctx(events)) == {}  # nothing answers on that port any more
    got = proxies.follow(ctx(events), {}, timeout=0.3)
    assert got["proxies"] == 0 and got["how"] == "fixed wait (no kube-proxy healthz)"


@pytest.mark.parametrize("skew", [timedelta(hours=-1), timedelta(hours=1)])
def test_the_freeze_waits_until_the_proxy_may_write_again(monkeypatch, skew):
    """A change written just before the freeze holds back the cutover's write by minSyncPeriod; settle
    returns once the proxy wrote the change and its last write is that old (0.5 s here)."""
    fake = FakeProxyHealthz(skew)
    monkeypatch.setattr(proxies, "HEALTHZ_PORT", fake.port)
    events: list[str] = []
    marks = proxies.mark(ctx(events))
    fake.queued = True
    threading.Timer(0.2, fake.sync).start()
    got = proxies.settle(ctx(events), marks, timeout=5)
    assert got["proxies"] == 1 and got["behind"] == []
    age = (fake.now() - fake.written).total_seconds()
    assert age >= 0.5 and got["seconds"] >= 0.65, (age, got)
    assert proxies.settle(ctx(events), {}, timeout=5) == {"proxies": 0, "seconds": 0.0}  # no kube-proxy: no wait
    fake.server.shutdown()
