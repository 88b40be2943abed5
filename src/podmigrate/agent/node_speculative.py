"""The node agent's speculative restores (``runtime.speculative``): the source's skeleton of a container,
the target's restores waiting at their gates, by checkpoint id.

Routes skeleton and speculate, registered with ``agent.node_lazy``'s, which takes a waiting
restore for its checkpoint's lazy restore, and a deleted checkpoint's is cancelled (``stop``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from podmigrate.agent.checkpoints import CheckpointDir
from podmigrate.agent.http import App, safe_id
from podmigrate.runtime import criu_conf, speculative
from podmigrate.runtime.speculative import Gate

if TYPE_CHECKING:
    from podmigrate.agent.node import NodeRuntime

GATE_WAIT_S = 20.0  # podman's part of a restore takes ~0.1 s here; much longer is a fault


class Speculations:
    def __init__(self, rt: NodeRuntime, files: CheckpointDir):
        self.rt, self.files = rt, files
        self.gates: dict[str, Gate] = {}
        self._lock = threading.Lock()
        for token in speculative.orphans():  # a restarted agent: the dead one's waiting restores failed
            speculative.clean_orphan(token)
        criu_conf.forget_runs()  # and its CRIU runs' option files are nobody's now

    def register(self, app: App) -> None:
        app.route("GET", "/v1/containers/(?P<name>[^/]+)/skeleton")(self.skeleton)
        app.route("POST", "/v1/checkpoints/(?P<cid>[^/]+)/speculate")(self.speculate)
        app.route("DELETE", "/v1/checkpoints/(?P<cid>[^/]+)/speculate")(self.cancel)

    def skeleton(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return self.rt.skeleton(p["name"])

    def speculate(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """Start a restore of ``b["skeleton"]`` and answer once podman waits at its gate; a restore
        that does not get there is cancelled before the error is returned."""
        cid = safe_id(p["cid"])
        self.stop(cid)  # a retried request: the earlier one goes first
        where = self.files.root / f"{cid}.skeleton.tar"
        gate = self.rt.speculate(cid, b["skeleton"], where, tcp_established=b.get("tcp_established", True))
        try:
            gate.wait(GATE_WAIT_S)
        except Exception:
            gate.cancel()
            raise
        finally:
            where.unlink(missing_ok=True)  # podman has imported it (or failed)
        with self._lock:
            self.gates[cid] = gate
        return {"started": gate.started, "at_gate": gate.reached}

    def take(self, cid: str) -> Gate | None:
        """The restore waiting for checkpoint ``cid``, if it still waits (one that died is removed)."""
        with self._lock:
            gate = self.gates.pop(safe_id(cid), None)
        if gate is not None and not gate.alive():
            gate.cancel()
            return None
        return gate

    def cancel(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"cancelled": self.stop(p["cid"])}

    def stop(self, cid: str) -> bool:
        with self._lock:
            gate = self.gates.pop(safe_id(cid), None)
        if gate is None:  # none of this agent's, but perhaps a dead one's
            return speculative.clean_orphan(safe_id(cid)) is not None
        gate.cancel()
        return True
