"""Whether a pod serves, asked of the agent on its node: the pod's own readiness probes (``httpGet``,
``tcpSocket``) and a connection to each port its Services send to, run at the pod's address as the
kubelet runs them, every few milliseconds until all answer.

A streamed migration's copy is the source's process, restored: it serves the moment its containers
run. The kubelet says so later (its next sync, the readiness probe's next period, its status
update); the operator hands the Services over as soon as this says so (``k8s.handover``). Route::

    POST /v1/serving    {address, checks: [{port, path?, scheme?, headers?}], timeout} -> {serving, seconds|why}
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from typing import Any

from podmigrate.agent.http import App
from podmigrate.errors import UsageError

STEP_S = 0.005
# a SYN dropped while CRIU holds the pod's network locked (its restore) is not answered: try again
# soon rather than wait for TCP's retransmission
CONNECT_S = 0.05
ANSWER_S = 1.0  # the kubelet's own probe timeout, at the least


def routes(app: App) -> None:
    app.route("POST", "/v1/serving")(lambda p, b: wait(b))


def wait(b: dict[str, Any]) -> dict[str, Any]:
    try:
        address = str(ipaddress.ip_address(str(b["address"])))
    except ValueError:
        raise UsageError(f"not a pod address: {b.get('address')!r}") from None
    checks = [dict(c) for c in b.get("checks") or []]
    if not checks:
        raise UsageError("no check to run: name the pod's readiness probes or its Services' ports")
    t0 = time.monotonic()
    until = t0 + float(b.get("timeout", 60))
    pending = checks
    last = ""
    while pending:
        failed = []
        for c in pending:
            why = attempt(address, c)
            if why:
                failed.append(c)
                last = why
        pending = failed
        if pending and time.monotonic() > until:
            return {"serving": False, "why": last}  # the caller looks at the pod, and asks again
        if pending:
            time.sleep(STEP_S)
    return {"serving": True, "seconds": time.monotonic() - t0}


def attempt(address: str, check: dict[str, Any]) -> str:
    """'' when ``check`` passes, else why not."""
    port = int(check["port"])
    if "path" not in check:
        try:
            socket.create_connection((address, port), timeout=CONNECT_S).close()
            return ""
        except OSError as e:
            return f"port {port}: {e}"
    https = str(check.get("scheme", "HTTP")).upper() == "HTTPS"
    conn: http.client.HTTPConnection
    if https:  # as the kubelet: no certificate check
        conn = http.client.HTTPSConnection(address, port, timeout=CONNECT_S, context=ssl._create_unverified_context())
    else:
        conn = http.client.HTTPConnection(address, port, timeout=CONNECT_S)
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(ANSWER_S)
        headers = {h["name"]: h["value"] for h in check.get("headers") or []}
        conn.request("GET", str(check["path"]) or "/", headers=headers)
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as e:
        return f"GET {check['path']} on port {port}: {e}"
    finally:
        conn.close()
    # the kubelet's rule: 200 <= status < 400 succeeds
    return "" if 200 <= status < 400 else f"GET {check['path']} on port {port}: HTTP {status}"
