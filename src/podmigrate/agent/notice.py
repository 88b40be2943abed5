"""A Spot interruption notice served on a lab node, as EC2's instance metadata serves it (standard
library only).

On EC2 a node learns it is going from ``/latest/meta-data/spot/instance-action``: 404 until AWS
decides, then ``{"action": "terminate", "time": "2026-12-04T08:22:00Z"}``, two minutes ahead.
``podmigrate lab notice`` puts one here (``PUT /v1/notice``); the node agent serves it at that path
and at ``GET /v1/notice`` (``{"instance_action": ... or null}``, what ``podmigrate watch`` polls).
It is kept in a file of the node's, so an agent restart does not forget it.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from podmigrate.agent.http import App
from podmigrate.errors import UsageError

ACTIONS = ("terminate", "stop", "hibernate")  # EC2's instance-action values


class NotFound(UsageError):
    """What IMDS answers before any notice: 404."""


def parse_time(text: str) -> float:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except (TypeError, ValueError):
        raise UsageError(f"not an instance-action time: {text!r}", hint="give it as 2026-12-04T08:22:00Z") from None


def document(action: str, at: float) -> dict[str, str]:
    """The instance-action document for ``action`` at epoch seconds ``at`` (whole seconds, UTC)."""
    if action not in ACTIONS:
        raise UsageError(f"not an instance action: {action!r}", hint=f"one of {', '.join(ACTIONS)}")
    return {"action": action, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(round(at)))}


class SpotNotice:
    def __init__(self, path: Path):
        self.path = path

    def register(self, app: App) -> None:
        app.route("PUT", "/v1/notice")(self.put)
        app.route("DELETE", "/v1/notice")(self.delete)
        app.route("GET", "/v1/notice")(self.get)
        app.route("GET", "/latest/meta-data/spot/instance-action")(self.imds)

    def current(self) -> dict[str, str] | None:
        try:
            doc: dict[str, str] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return doc

    def put(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        doc = document(str(b.get("action", "terminate")), parse_time(str(b.get("time"))))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)
        return {"instance_action": doc}

    def delete(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        was = self.current()
        self.path.unlink(missing_ok=True)
        return {"instance_action": was}

    def get(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"instance_action": self.current()}

    def imds(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        doc = self.current()
        if doc is None:
            raise NotFound("no interruption is scheduled for this instance")
        return doc
