"""A fake Kubernetes API (in memory) for fast unit tests of the operator's validate: objects by path,
JSON merge patches, a resourceVersion bumped on every write and checked when a patch carries one
(409 Conflict, as the API server answers), ``/status`` writing the object's status. Nothing else of
the API server: the operator's cases run on upstream Kubernetes (``tests/test_kube_*.py``)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

from podmigrate.k8s import api as k


def merge(into: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386: a null deletes, a dict merges, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


def _matches(obj: dict[str, Any], labels: str | None, fields: str | None) -> bool:
    """Equality selectors only (``a=b,c=d``): what the operator sends."""
    for term in (labels or "").split(","):
        if term:
            key, _, value = term.partition("=")
            if (obj["metadata"].get("labels") or {}).get(key) != value:
                return False
    for term in (fields or "").split(","):
        if term:
            key, _, value = term.partition("=")
            at: Any = obj
            for part in key.split("."):
                at = at.get(part) if isinstance(at, dict) else None
            if at != value:
                return False
    return True


class FakeKubeAPI:
    """``before_patch(path)`` runs before each patch is applied: a test's way to change an object
    between the operator's read and its write."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.versions = itertools.count(1)
        self.before_patch: Callable[[str], None] | None = None

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = str(next(self.versions))
        return copy.deepcopy(obj)

    def get(self, path: str) -> dict[str, Any] | None:
        obj = self.objects.get(path.rstrip("/"))
        return copy.deepcopy(obj) if obj else None

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list[Any]:
        prefix = path.rstrip("/") + "/"
        found = [o for p, o in self.objects.items() if p.startswith(prefix) and "/" not in p[len(prefix) :]]
        return [copy.deepcopy(o) for o in found if _matches(o, label_selector, field_selector)]

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        where = f"{path.rstrip('/')}/{obj['metadata']['name']}"
        if where in self.objects:
            raise k.KubeError(f"POST {path}: 409 AlreadyExists", details={"status": 409})
        self.objects[where] = copy.deepcopy(obj)
        return self._stamp(self.objects[where])

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        if self.before_patch:
            self.before_patch(path)
        where, status = (path[: -len("/status")], True) if path.endswith("/status") else (path, False)
        obj = self.objects.get(where)
        if obj is None:
            raise k.KubeError(f"PATCH {path}: 404 NotFound", details={"status": 404})
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            raise k.KubeError(f"PATCH {path}: 409 Conflict: the object has been modified", details={"status": 409})
        merge(obj, {"status": patch.get("status")} if status else {**patch, "status": obj.get("status")})
        return self._stamp(obj)

    def delete(self, path: str) -> bool:
        return self.objects.pop(path.rstrip("/"), None) is not None

    def close(self) -> None:
        pass
