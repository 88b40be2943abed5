"""The Kubelet Checkpoint API (KEP-2008), as the node agent calls it on its own node.

``POST https://<node>:10250/checkpoint/{namespace}/{pod}/{container}?timeout=<s>`` with the agent's
service-account token (RBAC: ``create`` on ``nodes/checkpoint``). The kubelet asks the runtime (CRI-O)
for a checkpoint, leaves the container running, and answers
``{"items": ["/var/lib/kubelet/checkpoints/checkpoint-<pod>_<ns>-<container>-<timestamp>.tar"]}``.
It never deletes the archive: the agent does, once the image is pushed.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

from podmigrate.errors import RuntimeBackendError

CHECKPOINT_DIR = Path("/var/lib/kubelet/checkpoints")

_HINTS = {
    401: "the agent's token was refused: check its ServiceAccount token mount",
    403: "RBAC: the agent's ServiceAccount needs `create` on `nodes/checkpoint`",
    404: "no such pod or container on this node, or the ContainerCheckpoint feature gate is off "
    "(Kubernetes < 1.30 needs --feature-gates=ContainerCheckpoint=true on the kubelet)",
    500: "the runtime failed to checkpoint: CRIU's dump log on the node says why (its path is in the "
    "message, or in the kubelet's log); CRI-O also needs enable_criu_support = true and CRIU >= 4.2",
}


class KubeletClient:
    """Standard library only (the agent image stays small)."""

    def __init__(self, url: str, token: str | Path, ca: str | None = None, insecure: bool = False):
        """``token``: the token, or the file that holds it (read at every call: projected
        service-account tokens rotate)."""
        self.url = url.rstrip("/")
        self._token = token
        if url.startswith("https"):
            self.ctx: ssl.SSLContext | None = ssl.create_default_context(cafile=ca)
            if insecure:  # kubelets commonly serve self-signed certificates (metrics-server has the same flag)
                self.ctx.check_hostname = False
                self.ctx.verify_mode = ssl.CERT_NONE
        else:
            self.ctx = None

    # a kubelet just restarted answers 404 "pod does not exist" until it has taken in its pods from the
    # API server (seconds); the operator validated that the pod runs on this node, so this is waited out
    SETTLE_S = 30.0

    def checkpoint(self, namespace: str, pod: str, container: str, timeout: int = 120) -> Path:
        deadline = time.monotonic() + self.SETTLE_S
        while True:
            try:
                return self._checkpoint(namespace, pod, container, timeout)
            except RuntimeBackendError as e:
                settling = e.details.get("status") == 404 and "pod does not exist" in str(e)
                if not settling or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def _checkpoint(self, namespace: str, pod: str, container: str, timeout: int) -> Path:
        url = f"{self.url}/checkpoint/{namespace}/{pod}/{container}?timeout={timeout}"
        token = self._token.read_text().strip() if isinstance(self._token, Path) else self._token
        req = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout + 30, context=self.ctx) as resp:
                body = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read(2000).decode(errors="replace").strip()
            raise RuntimeBackendError(
                f"kubelet refused the checkpoint of {namespace}/{pod}/{container}: {e.code} {text}",
                hint=_HINTS.get(e.code),
                details={"status": e.code},
            ) from e
        except (OSError, ValueError) as e:
            raise RuntimeBackendError(
                f"kubelet at {self.url} unreachable or answered garbage: {e}",
                hint="the agent reaches the kubelet at the node's address (status.hostIP), port 10250",
            ) from e
        items = body.get("items") or []
        if len(items) != 1 or not str(items[0]).endswith(".tar"):
            raise RuntimeBackendError(f"kubelet answered an unexpected body to the checkpoint: {body!r}")
        return Path(items[0])
