"""The agents' HTTP layer and the transport lookup, without root, a lab or a runtime.

``agent.http.App`` is what every agent (node, LAN, Kubernetes) serves: its token check, its 404 and
its errors as JSON are the contract the host-side client reads. ``transport.TRANSPORTS`` must
cover every ``--transport`` the engine accepts, each a sibling module implementing the protocol.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from podmigrate import transport
from podmigrate.agent.http import App, make_handler, safe_id
from podmigrate.engine.controller import TRANSPORTS as ENGINE_TRANSPORTS
from podmigrate.errors import PodmigrateError, UsageError
from podmigrate.transport.base import Transport
from tests.tls_helpers import serving

TOKEN = "s3cret"


def app() -> App:
    a = App("node-z", "node", TOKEN)

    @a.route("GET", "/v1/things/(?P<name>[^/]+)")
    def thing(p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"name": p["name"], "body": b}

    @a.route("POST", "/v1/things")
    def bad(p: dict[str, str], b: dict[str, Any]) -> Any:
        raise UsageError("no such thing", hint="ask for another", details={"thing": b.get("name")})

    @a.route("POST", "/v1/boom")
    def boom(p: dict[str, str], b: dict[str, Any]) -> Any:
        raise ZeroDivisionError("division by zero")

    return a


def dispatch(a: App, method: str, path: str, auth: str | None = f"Bearer {TOKEN}", body: Any = None) -> tuple[int, Any]:
    return a.dispatch(method, path, auth, lambda: body if body is not None else {})


@pytest.mark.parametrize("auth", [None, "", "Bearer wrong", TOKEN, f"Basic {TOKEN}"])
def test_a_request_without_the_right_token_gets_401_naming_the_agent(auth: str | None) -> None:
    read: list[bool] = []

    def load() -> dict[str, Any]:
        read.append(True)
        return {}

    status, data = app().dispatch("GET", "/v1/things/a", auth, load)
    assert status == 401
    assert data["error"]["kind"] == "AgentError"
    assert data["error"]["message"] == "agent node-z: missing or wrong token"
    assert data["error"]["hint"] == "use the lab's token file"
    assert not read, "the body must not be read before the token is checked"


def test_a_request_with_the_right_token_reaches_its_route_with_the_path_parameters() -> None:
    assert dispatch(app(), "GET", "/v1/things/web?verbose=1", body={"x": 1}) == (
        200,
        {"name": "web", "body": {"x": 1}},
    )


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/nothing"), ("DELETE", "/v1/things/a"), ("GET", "/v1/things")]
)
def test_an_unknown_route_or_method_is_a_404_usage_error(method: str, path: str) -> None:
    status, data = dispatch(app(), method, path)
    assert status == 404
    assert data == {
        "error": {"kind": "UsageError", "message": f"agent node-z has no {method} {path}", "hint": None, "details": {}}
    }


def test_a_usage_error_is_a_400_in_the_errors_wire_shape_with_the_node_added() -> None:
    status, data = dispatch(app(), "POST", "/v1/things", body={"name": "x"})
    assert status == 400
    assert data == {
        "error": {
            "kind": "UsageError",
            "message": "no such thing",
            "hint": "ask for another",
            "details": {"thing": "x", "node": "node-z"},
        }
    }
    err = PodmigrateError.from_wire(data["error"])
    assert isinstance(err, UsageError) and err.hint == "ask for another"


def test_an_unexpected_exception_is_a_500_that_names_the_request_and_keeps_the_traceback_in_the_log(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, data = dispatch(app(), "POST", "/v1/boom")
    assert status == 500
    err = data["error"]
    assert err["kind"] == "AgentError"
    assert err["message"] == "agent node-z: POST /v1/boom failed (ZeroDivisionError)"
    assert err["details"] == {"node": "node-z"}, "a reply crosses the network: no traceback, no exception text"
    assert "division by zero" not in json.dumps(data)
    log = capsys.readouterr().err
    assert "POST /v1/boom failed" in log and "ZeroDivisionError: division by zero" in log


@pytest.fixture
def served() -> Iterator[int]:
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), make_handler(app()))) as port:
        yield port


def test_the_handler_answers_json_with_its_length_and_hangs_up_after_an_error_saying_so(served: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served, timeout=5)
    body = json.dumps({"a": 1}).encode()
    conn.request("GET", "/v1/things/web", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
    resp = conn.getresponse()
    raw = resp.read()
    assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
    assert int(resp.headers["Content-Length"]) == len(raw)
    assert json.loads(raw) == {"name": "web", "body": {"a": 1}}
    conn.request("POST", "/v1/things", body=b"{}", headers={"Authorization": "Bearer wrong"})
    resp = conn.getresponse()
    assert resp.status == 401 and json.loads(resp.read())["error"]["kind"] == "AgentError"
    # the refused request's body may be unread: the server hangs up instead of parsing it as a
    # request, and says so, so that a keep-alive client opens a new connection for the next one
    assert resp.headers["Connection"] == "close"
    conn.request("GET", "/v1/things/web", headers={"Authorization": f"Bearer {TOKEN}"})
    assert conn.getresponse().status == 200
    conn.close()


def test_a_checkpoint_id_that_could_leave_the_checkpoint_directory_is_refused() -> None:
    assert safe_id("20261201-abc.web_1") == "20261201-abc.web_1"
    for bad in ("../x", "a/b", "", "x" * 129, "a b"):
        with pytest.raises(UsageError):
            safe_id(bad)


@pytest.mark.parametrize("name", ENGINE_TRANSPORTS)
def test_every_transport_the_engine_accepts_is_a_sibling_module_that_satisfies_the_protocol(name: str) -> None:
    impl = transport.get(name)
    assert impl.__module__ == f"podmigrate.transport.{name}"
    assert issubclass(impl, Transport)


def test_the_transport_lookup_names_exactly_the_engines_transports_and_refuses_others() -> None:
    assert set(transport.TRANSPORTS) == set(ENGINE_TRANSPORTS)
    with pytest.raises(UsageError, match="unknown transport 'carrier-pigeon'") as e:
        transport.get("carrier-pigeon")
    assert e.value.hint == "transports: registry, stream, archive"
