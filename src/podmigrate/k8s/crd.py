"""The PodLiveMigration custom resource: its OpenAPI v3 schema, the CRD manifest, spec validation.

The schema here is the only source: ``podmigrate k8s crd`` prints the manifest, and a test checks that
``deploy/kubernetes/base/crd.yaml`` is exactly that output. The operator validates every spec against the
same schema (an API server with the CRD installed already rejects what the schema forbids; the operator
checks again because a spec can come from an older CRD) and then checks what a schema cannot say.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema

GROUP = "podmigrate.io"
VERSION = "v1alpha1"
KIND = "PodLiveMigration"
PLURAL = "podlivemigrations"
SINGULAR = "podlivemigration"
SHORT_NAMES = ["plm"]
API_VERSION = f"{GROUP}/{VERSION}"

MODES = ("decoupled", "stop-copy", "lazy", "cold")
PHASES = ("Pending", "Checkpointing", "Transferring", "Restoring", "CuttingOver", "Completed", "Failed", "RolledBack")
TERMINAL = ("Completed", "Failed", "RolledBack")
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["podName"],
    # a migration is a request, not a desired state: changing it mid-way would mix two plans
    "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "spec is immutable; create a new migration"}],
    "properties": {
        "podName": {
            "type": "string",
            "maxLength": 253,
            "pattern": _DNS_SUBDOMAIN,
            "description": "The pod to move, in the PodLiveMigration's namespace.",
        },
        "containers": {
            "type": "array",
            "items": {"type": "string", "pattern": _DNS_LABEL, "maxLength": 63},
            "description": "Containers to checkpoint. Empty or absent: every container of the pod (the whole "
            "pod). A subset starts the others fresh from their images, which severs their loopback "
            "connections with the checkpointed ones (the study's finding); the operator warns.",
        },
        "targetNode": {
            "type": "string",
            "maxLength": 253,
            "pattern": _DNS_SUBDOMAIN,
            "description": "Node to move the pod to. Absent: any other Ready node matching targetNodeSelector.",
        },
        "targetNodeSelector": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Labels the target node must carry when targetNode is absent.",
        },
        "mode": {
            "type": "string",
            "enum": list(MODES),
            "default": "decoupled",
            "description": "decoupled: the source serves until the copy is ready (the study's Mode A); "
            "stop-copy: the source leaves the Service before its checkpoint, so no request reaches a copy "
            "that will be discarded (Mode B); lazy: post-copy, the copy runs before its memory has moved and "
            "the pages follow (transport stream); cold: a fresh pod from the original images, state lost (the "
            "baseline).",
        },
        "transport": {
            "type": "string",
            "enum": ["registry", "stream"],
            "default": "registry",
            "description": "How the checkpoint moves. registry: the kubelet's checkpoint (KEP-2008) as an OCI "
            "image, pulled by the target (any node). stream: the source's agent checkpoints with runc and its "
            "pages go straight into the copy, whose pod waits on the target before the freeze (the podmigrate "
            "RuntimeClass on the target, agents from deploy/kubernetes/stream on both; the migration is sealed). "
            "status.transport says which was taken.",
        },
        "compression": {"type": "string", "enum": ["none", "gzip", "zstd"], "default": "none"},
        "restorePath": {
            "type": "string",
            "enum": ["auto", "cri", "runtimeclass"],
            "default": "auto",
            "description": "How the target restores: cri (the runtime restores the checkpoint image: "
            "containerd 2.1-2.3, CRI-O with restore on), runtimeclass (the node agent verifies the image and "
            "the podmigrate RuntimeClass restores it: any runc-based runtime), auto: cri where the runtime "
            "has it, else runtimeclass. status.restorePath says which was taken.",
        },
        "registry": {
            "type": "string",
            "maxLength": 255,
            # a host with a dot or a port, or localhost: CRI-O would read "myreg/x" as docker.io/myreg/x
            "pattern": r"^([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+(:[0-9]{1,5})?|[A-Za-z0-9.-]+:[0-9]{1,5}|localhost)"
            r"(/[a-z0-9._/-]+)?$",
            "description": "Registry and repository prefix for checkpoint images, e.g. "
            "registry.example:5000/checkpoints. Absent: the operator's default.",
        },
        "service": {
            "type": "string",
            "pattern": _DNS_LABEL,
            "maxLength": 63,
            "description": "Service to switch. Absent: every Service in the namespace that selects the pod.",
        },
        "timeouts": {
            "type": "object",
            "properties": {
                "checkpointSeconds": {"type": "integer", "minimum": 1, "maximum": 3600, "default": 120},
                "restoreSeconds": {"type": "integer", "minimum": 1, "maximum": 3600, "default": 300},
            },
        },
    },
}

_SECONDS = {"type": "number"}
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": list(PHASES)},
        "message": {"type": "string"},
        "reason": {"type": "string"},
        "sourceNode": {"type": "string"},
        "targetNode": {"type": "string"},
        "restoredPod": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "node": {"type": "string"}},
        },
        "checkpointImages": {"type": "object", "additionalProperties": {"type": "string"}},
        "restorePath": {"type": "string", "enum": ["cri", "runtimeclass"]},
        "transport": {"type": "string", "enum": ["registry", "stream", "none"]},
        "phaseTimings": {
            "type": "object",
            "additionalProperties": _SECONDS,
            "description": "Seconds per phase: validate, isolate, checkpoint, package, restore, cutover, cleanup.",
        },
        "blackoutSeconds": {
            **_SECONDS,
            "description": "Time the Service had no ready endpoint (stop-copy: isolate to cutover; else 0).",
        },
        "driftSeconds": {
            **_SECONDS,
            "description": "How long the source served after its checkpoint (the study's RPO, in time).",
        },
        "bytes": {"type": "integer", "description": "Checkpoint image bytes pushed (all containers)."},
        "startedAt": {"type": "string", "format": "date-time"},
        "completedAt": {"type": "string", "format": "date-time"},
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                },
            },
        },
        "record": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "The controller's own record (phases done, what to undo); lets a restarted "
            "operator resume or roll back.",
        },
    },
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Pod", "type": "string", "jsonPath": ".spec.podName"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "From", "type": "string", "jsonPath": ".status.sourceNode"},
    {"name": "To", "type": "string", "jsonPath": ".status.targetNode"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Blackout", "type": "number", "jsonPath": ".status.blackoutSeconds", "priority": 1},
    {"name": "Restored", "type": "string", "jsonPath": ".status.restoredPod.name", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def definition(
    names: dict[str, Any], scope: str, columns: list[dict[str, Any]], schema: dict[str, Any]
) -> dict[str, Any]:
    """A CustomResourceDefinition of this group: one served version with a status subresource."""
    version = {"name": VERSION, "served": True, "storage": True, "subresources": {"status": {}},
               "additionalPrinterColumns": columns, "schema": {"openAPIV3Schema": schema}}  # fmt: skip
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names['plural']}.{GROUP}"},
        "spec": {"group": GROUP, "scope": scope, "names": names, "versions": [version]},
    }


def crd_manifest() -> dict[str, Any]:
    names = {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES}
    schema = {
        "type": "object",
        "description": "Move a running pod to another node with its memory (CRIU).",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": SPEC_SCHEMA,
            "status": STATUS_SCHEMA,
        },
    }
    return definition(names, "Namespaced", PRINTER_COLUMNS, schema)


def _with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply the schema's defaults the way the API server does (structural schemas)."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = _with_defaults(sub, out[key])
    return out


class SpecError(ValueError):
    """A PodLiveMigration spec that cannot run; the message says which field and what to do."""

    def __init__(self, message: str, hint: str | None = None, reason: str = "InvalidSpec"):
        super().__init__(message)
        self.hint = hint
        self.reason = reason  # the status's reason: InvalidSpec, or what else made the spec unrunnable


def check_schema(schema: dict[str, Any], spec: dict[str, Any]) -> None:
    """``SpecError`` naming the first field (by path) that ``schema`` rejects."""
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(spec), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = "spec." + ".".join(str(p) for p in e.path) if e.path else "spec"
        raise SpecError(f"{where}: {e.message}")


def validate_spec(spec: Any) -> dict[str, Any]:
    """Return the spec with defaults applied, or raise ``SpecError`` naming the field at fault."""
    if not isinstance(spec, dict):
        raise SpecError("spec must be an object with at least podName")
    check_schema(SPEC_SCHEMA, spec)
    out: dict[str, Any] = _with_defaults(SPEC_SCHEMA, spec)
    out.setdefault("timeouts", _with_defaults(SPEC_SCHEMA["properties"]["timeouts"], {}))
    if out.get("targetNode") and out.get("targetNodeSelector"):
        raise SpecError("spec: give targetNode or targetNodeSelector, not both")
    names = out.get("containers") or []
    if len(set(names)) != len(names):
        raise SpecError("spec.containers: a container is listed twice")
    if out["mode"] == "cold" and names:
        raise SpecError("spec.containers: a cold restart checkpoints nothing; leave containers out")
    if out["mode"] == "lazy":  # its pages move as the copy runs: always streamed (registry is only the default)
        out["transport"] = "stream"
    if out["transport"] == "stream" and out["mode"] == "cold":
        raise SpecError("spec.transport: a cold restart moves no checkpoint; stream needs decoupled or stop-copy")
    if out["transport"] == "stream" and out["restorePath"] == "cri":
        raise SpecError(
            "spec.restorePath: a streamed checkpoint is restored by the podmigrate RuntimeClass, not by CRI",
            hint="leave restorePath out (or runtimeclass), or use transport registry",
        )
    return out


def short_name(name: str) -> str:
    """Strip a suffix an earlier migration added, so names do not grow with every move."""
    return re.sub(r"-m[0-9a-f]{6}$", "", name)
