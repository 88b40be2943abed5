"""A small Kubernetes REST client: the dozen calls the controller makes, with JSON merge patches only.

Configuration, in order: an explicit ``server`` (``PODMIGRATE_KUBE_SERVER``, development), the pod's
service account (in-cluster), then ``$KUBECONFIG`` or ``~/.kube/config`` (token or client
certificate of the current context). Errors become ``KubeError`` with the API's own status and
message, so callers can tell a missing object (404) from a conflict (409) or a denial (403).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from podmigrate.errors import PodmigrateError

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE = {"Content-Type": "application/merge-patch+json"}


class KubeError(PodmigrateError):
    """The Kubernetes API refused a request or could not be reached."""

    @property
    def status(self) -> int:
        return int(self.details.get("status", 0))


@dataclass
class KubeConfig:
    server: str
    token: str | None = None
    verify: bool | str = True
    cert: tuple[str, str] | None = None

    @classmethod
    def load(cls, server: str | None = None) -> KubeConfig:
        if server:
            return cls(server=server, token=os.environ.get("PODMIGRATE_KUBE_TOKEN"), verify=False)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if host and port and (SA_DIR / "token").exists():
            return cls(
                server=f"https://{host}:{port}",
                token=(SA_DIR / "token").read_text().strip(),
                verify=str(SA_DIR / "ca.crt"),
            )
        return cls._from_kubeconfig(Path(os.environ.get("KUBECONFIG", Path.home() / ".kube/config")))

    @classmethod
    def _from_kubeconfig(cls, path: Path) -> KubeConfig:
        import yaml  # only needed outside a cluster

        if not path.exists():
            raise KubeError(
                "no Kubernetes configuration: not in a pod, and no kubeconfig at " + str(path),
                hint="set KUBECONFIG, or run inside the cluster with a service account",
            )
        doc = yaml.safe_load(path.read_text())
        ctx_name = doc.get("current-context")
        ctx = next((c["context"] for c in doc.get("contexts", []) if c["name"] == ctx_name), None)
        if ctx is None:
            raise KubeError(f"{path}: current-context {ctx_name!r} is not defined")
        cluster = next(c["cluster"] for c in doc.get("clusters", []) if c["name"] == ctx["cluster"])
        user: dict[str, Any] = next((u["user"] for u in doc.get("users", []) if u["name"] == ctx.get("user")), {})
        verify: bool | str = not cluster.get("insecure-skip-tls-verify", False)
        if "certificate-authority-data" in cluster:
            verify = _write_temp(base64.b64decode(cluster["certificate-authority-data"]))
        elif "certificate-authority" in cluster:
            verify = cluster["certificate-authority"]
        cert = None
        if "client-certificate-data" in user:
            cert = (
                _write_temp(base64.b64decode(user["client-certificate-data"])),
                _write_temp(base64.b64decode(user["client-key-data"])),
            )
        elif "client-certificate" in user:
            cert = (user["client-certificate"], user["client-key"])
        return cls(server=cluster["server"], token=user.get("token"), verify=verify, cert=cert)


def _write_temp(data: bytes) -> str:
    """A kubeconfig's inline CA, certificate or key as the file httpx needs: 0600 (mkstemp) and
    removed when this process exits, since a client key is a credential."""
    fd, name = tempfile.mkstemp(prefix="podmigrate-kube-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    atexit.register(_remove, name)
    return name


def _remove(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


class KubeAPI:
    def __init__(self, config: KubeConfig, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self.server = config.server
        self._http = httpx.Client(
            base_url=config.server, headers=headers, verify=config.verify, cert=config.cert, timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None) -> Any:
        headers = MERGE if method == "PATCH" else None
        try:
            resp = self._http.request(method, path, json=body, params=params, headers=headers)
        except httpx.TransportError as e:
            raise KubeError(
                f"Kubernetes API {self.server} unreachable: {type(e).__name__}: {e}", details={"status": 0}
            ) from e
        if resp.status_code >= 300:
            try:
                msg = resp.json().get("message") or resp.text
            except ValueError:
                msg = resp.text
            raise KubeError(
                f"{method} {path}: {resp.status_code} {msg[:500]}",
                details={"status": resp.status_code},
                hint="check the operator's RBAC" if resp.status_code == 403 else None,
            )
        return resp.json() if resp.content else {}

    # -------------------------------------------------------------------------------- core objects
    def get(self, path: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.request("GET", path)
            return obj
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list[Any]:
        params = {k: v for k, v in {"labelSelector": label_selector, "fieldSelector": field_selector}.items() if v}
        items: list[Any] = self.request("GET", path, params=params or None).get("items", [])
        return items

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.request("POST", path, obj)
        return out

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.request("PATCH", path, patch)
        return out

    def delete(self, path: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            self.request("DELETE", path)
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise


def pods(ns: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/pods" + (f"/{name}" if name else "")


def services(ns: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/services" + (f"/{name}" if name else "")


def nodes(name: str = "") -> str:
    return "/api/v1/nodes" + (f"/{name}" if name else "")


def migrations(ns: str, name: str = "", status: bool = False) -> str:
    from podmigrate.k8s.crd import GROUP, PLURAL, VERSION

    base = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"
    return base + (f"/{name}" if name else "") + ("/status" if status else "")


def pod_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )


def node_ready(node: dict[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (node.get("status") or {}).get("conditions", [])
    )


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
