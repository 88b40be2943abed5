"""Router none (``engine.phases.published``): what a container publishes decides whether it can
follow to another host, and where its clients find it. Pure functions, no agents."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from podmigrate.engine.phases import published
from podmigrate.errors import UsageError


def port(container: int, host: int, host_ip: str = "") -> dict[str, Any]:
    return {"container_port": container, "protocol": "tcp", "host_ip": host_ip, "host_port": host}


def test_ports_published_on_every_address_follow_the_container() -> None:
    spec = {"published": [port(8000, 8080), port(9000, 9090, "0.0.0.0")]}
    assert published.check(spec, "web", "stop-copy") == spec["published"]
    assert published.check({}, "worker", "lazy") == []  # nothing published: nothing to re-create


def test_a_port_on_the_hosts_own_address_or_a_cold_move_is_refused() -> None:
    with pytest.raises(UsageError, match=r"'web' publishes ports on its host's own address \(192.0.2.11:8080\)"):
        published.check({"published": [port(8000, 8080, "192.0.2.11")]}, "web", "stop-copy")
    with pytest.raises(UsageError, match="mode 'cold' is not built"):
        published.check({"published": []}, "web", "cold")


def test_the_endpoint_is_the_hosts_address_and_the_published_port() -> None:
    rec: dict[str, Any] = {"container": "web", "published": [port(8000, 8080)], "plan": {"tcp_established": True}}
    ctx: Any = SimpleNamespace(rec=rec, lab=SimpleNamespace(node_address={"a": "192.0.2.11"}.__getitem__))
    assert published.endpoint(ctx, "a", 8000) == ("192.0.2.11", 8080)
    with pytest.raises(UsageError, match="'web' does not publish port 9000") as e:
        published.endpoint(ctx, "a", 9000)
    assert "-p HOSTPORT:9000" in (e.value.hint or "")
    published.take(ctx, rec["published"])
    assert (rec["keep_address"], rec["service_addresses"], rec["plan"]["tcp_established"]) == (False, [], False)
    assert rec["tcp"].startswith("open connections are closed")
