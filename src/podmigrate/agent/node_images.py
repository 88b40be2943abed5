"""The node agent's image routes: an image pulled, sent to another node's agent by ID and loaded
there (nodes without a registry), and whether a checkpoint from another CPU runs here; and the
routes that move a service address on a shared L2 segment to this node or away from it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate import names
from podmigrate.agent.checkpoints import CheckpointDir
from podmigrate.agent.http import App, safe_id
from podmigrate.agent.peers import Peers
from podmigrate.transport.base import Sent
from podmigrate.transport.stream import StreamTransport

if TYPE_CHECKING:
    from podmigrate.runtime.base import Runtime


class NodeImages:
    def __init__(self, rt: Runtime, files: CheckpointDir, stream: StreamTransport, peers: Peers):
        self.rt, self.files, self.stream, self.peers = rt, files, stream, peers

    def register(self, app: App) -> None:
        app.route("POST", "/v1/images")(self.ensure_image)
        app.route("POST", "/v1/images/send")(self.send_image)
        app.route("POST", "/v1/cpuinfo/check")(self.cpuinfo_check)
        app.route("POST", "/v1/images/load")(self.load_image)
        # hosts on one L2 segment (the hosts' l2 router, ``runtime.l2``): where a service address is
        app.route("POST", "/v1/l2/withdraw")(lambda p, b: self.rt.withdraw(str(b["address"])))
        app.route("POST", "/v1/l2/announce")(lambda p, b: self.rt.announce(str(b["address"])))

    def _send(self, cid: str, archive: Path, to: str) -> Sent:
        with self.files.busy(cid):
            return self.stream.send(archive, to)

    def ensure_image(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        t0 = time.time()
        got = self.rt.ensure_image(names.image(b.get("image")), b.get("id", ""))
        return {"image": b["image"], **got, "seconds": time.time() - t0}

    def cpuinfo_check(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        return {"why": self.rt.cpuinfo_check(str(b["image"]))}

    def send_image(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        """The image (by ID) to another node's agent, as a checkpoint stream is sent (SHA-256 checked)."""
        image_id, cid = str(b["id"]), f"image-{safe_id(str(b['id'])[:12])}"
        archive = self.files.archive(cid)
        try:
            self.rt.save_image(image_id, archive)
            os.chmod(archive, 0o600)
            return {"checkpoint_id": cid, **self._send(cid, archive, self.peers.address(b["node"]))}
        finally:
            self.files.remove(cid)

    def load_image(self, p: dict[str, str], b: dict[str, Any]) -> Any:
        cid = safe_id(b["checkpoint_id"])
        with self.files.busy(cid):
            try:
                self.rt.load_image(self.files.archive(cid), str(b["id"]), str(b.get("image", "")))
            finally:
                self.files.remove(cid)
        return {"image": b.get("image"), "id": b["id"]}
