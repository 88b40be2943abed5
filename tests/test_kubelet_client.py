"""The agent's kubelet client against a stand-in kubelet on loopback (plain HTTP): a kubelet just
restarted answers 404 "pod does not exist" until it has its pods, which is waited out; any other
refusal is not."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from podmigrate.errors import RuntimeBackendError
from podmigrate.k8s.kubelet import KubeletClient
from tests.tls_helpers import serving


class Settling(BaseHTTPRequestHandler):
    """Answers ``answers`` in turn (status, text), then a checkpoint's path."""

    answers: ClassVar[list[tuple[int, str]]] = []
    calls: ClassVar[list[str]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.calls.append(self.path)
        status, text = self.answers.pop(0) if self.answers else (200, json.dumps({"items": ["/x/c.tar"]}))
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def client(port: int, settle: float) -> KubeletClient:
    c = KubeletClient(f"http://127.0.0.1:{port}", "token")
    c.SETTLE_S = settle
    return c


def test_a_kubelet_that_does_not_know_the_pod_yet_is_waited_for() -> None:
    Settling.answers[:] = [(404, "pod does not exist"), (404, "pod does not exist")]
    Settling.calls.clear()
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), Settling)) as port:
        assert client(port, 30).checkpoint("default", "web", "server") == Path("/x/c.tar")
    assert len(Settling.calls) == 3


@pytest.mark.parametrize(
    ("answers", "settle", "match"),
    [
        ([(404, "404 page not found")], 30, "ContainerCheckpoint feature gate is off"),  # not settling: at once
        ([(403, "forbidden")], 30, "nodes/checkpoint"),
        ([(404, "pod does not exist")] * 50, 1, "pod does not exist"),  # it never came: given up
    ],
)
def test_other_refusals_and_a_pod_that_never_comes_fail(
    answers: list[tuple[int, str]], settle: float, match: str
) -> None:
    Settling.answers[:] = answers
    Settling.calls.clear()
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), Settling)) as port, pytest.raises(RuntimeBackendError) as e:
        client(port, settle).checkpoint("default", "web", "server")
    assert match in str(e.value) + (e.value.hint or "")
    assert (len(Settling.calls) == 1) is (settle == 30)
