"""Which way the target node's runtime can restore a checkpoint: CRI, the podmigrate RuntimeClass, or neither.

- **cri**: the kubelet creates the copy from the checkpoint image and the runtime restores it in
  ``CreateContainer``. containerd has this in 2.1-2.3 only (added in 2.1, removed in 2.4). CRI-O has
  it, but ships it off (``container_level_enabled = checkpoint_only``): a node whose CRI-O has it on
  must say so with the label ``podmigrate.io/cri-restore=true``.
- **runtimeclass**: the node agent fetches and verifies the image, and the ``podmigrate`` RuntimeClass
  (``runtime.runc_restore``) restores it where runc would create the container: any runtime that
  runs runc-compatible OCI runtimes, whatever its own restore support.

The runtime and version come from the Node (``status.nodeInfo.containerRuntimeVersion``, which the
kubelet fills from CRI ``Version``); the RuntimeClass from the API and the target agent's ``/v1/info``.
"""

from __future__ import annotations

import re
from typing import Any

CRI_RESTORE_LABEL = "podmigrate.io/cri-restore"
RUNTIME_CLASS = "podmigrate"
PATHS = ("auto", "cri", "runtimeclass")


def runtime_of(node: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """("containerd", (2, 1, 9)) from ``containerd://2.1.9``; ("", ()) when the node says nothing."""
    raw = str(((node.get("status") or {}).get("nodeInfo") or {}).get("containerRuntimeVersion", ""))
    name, _, version = raw.partition("://")
    nums = tuple(int(x) for x in re.findall(r"\d+", version.split("-")[0])[:3])
    return name, nums


def cri_restore(node: dict[str, Any]) -> str | None:
    """None when the node's runtime restores through CRI; else why not."""
    name, v = runtime_of(node)
    label = ((node.get("metadata") or {}).get("labels") or {}).get(CRI_RESTORE_LABEL)
    shown = f"{name} {'.'.join(map(str, v))}" if name else "an unreported runtime"
    if name == "containerd":
        if (2, 1) <= v[:2] < (2, 4):
            return None
        why = "added in 2.1" if v[:2] < (2, 1) else "removed in 2.4"
        return f"it runs {shown}, which has no CRI checkpoint restore ({why})"
    if name == "cri-o":
        if label == "true":
            return None
        return f"it runs {shown}, whose restore is off by default (label the node {CRI_RESTORE_LABEL}=true if on)"
    return f"it runs {shown}, which podmigrate does not know to restore through CRI"


def choose(wanted: str, node: dict[str, Any], runtime_class: bool) -> tuple[str | None, str]:
    """(path, why): the path to take for ``wanted`` (auto|cri|runtimeclass), or (None, the reason)."""
    no_cri = cri_restore(node)
    no_rc = None if runtime_class else f"no {RUNTIME_CLASS} RuntimeClass with a node agent that serves it there"
    if wanted in ("auto", "cri") and no_cri is None:
        return "cri", "the runtime restores checkpoint images through CRI"
    if wanted in ("auto", "runtimeclass") and no_rc is None:
        return "runtimeclass", "through the podmigrate RuntimeClass" + (f" ({no_cri})" if no_cri else "")
    reasons = [r for w, r in (("cri", no_cri), ("runtimeclass", no_rc)) if r and wanted in ("auto", w)]
    return None, "; ".join(reasons)
