"""What the operator and the node agents agree to touch: registries (an allow-list of ``host[/path]``)
and namespaces; and image references by digest.

A checkpoint is a process's memory, secrets included: whoever can create a PodLiveMigration must not
be able to send it to a registry of their choosing (``spec.registry``), nor restore a pod from one
(a crafted checkpoint is code). So the operator refuses, at validate, before anything is frozen, a
registry outside ``PODMIGRATE_ALLOWED_REGISTRIES`` (default: its own ``PODMIGRATE_REGISTRY``) and a
namespace outside ``PODMIGRATE_NAMESPACES`` (default: all); each node agent checks the same lists
again on every request, so an operator tricked or taken over still cannot push elsewhere.

An entry ``host[:port][/path-prefix]`` allows that host (exactly: ``registry.example`` is not
``registry.example:443``) and, with a path, only repositories at or under that path, component by
component (``reg/ckpt`` allows ``reg/ckpt/x`` and ``reg/ckpt``, not ``reg/ckpt-evil``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

REGISTRIES_ENV = "PODMIGRATE_ALLOWED_REGISTRIES"
NAMESPACES_ENV = "PODMIGRATE_NAMESPACES"

_HOST = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)(?::[0-9]{1,5})?$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")  # the distribution spec's path component
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class Refused(ValueError):
    """A registry, reference or namespace outside the policy; the message says how to allow it."""


def split(name: str) -> tuple[str, list[str]]:
    """``host[:port]/a/b[:tag|@digest]`` -> (host, [a, b]); refuses what is not a plain reference
    (no userinfo, no empty, ``.`` or ``..`` components: a registry may not normalize them as we do)."""
    host, _, path = name.partition("/")
    if "@" in path:
        path, _, digest = path.partition("@")
        if not _DIGEST.fullmatch(digest):
            raise Refused(f"{name!r}: {digest!r} is not a sha256 digest")
    head, _, last = path.rpartition("/")
    if ":" in last:  # a tag (a port can only be in the host part)
        path = f"{head}/{last.partition(':')[0]}" if head else last.partition(":")[0]
    parts = path.split("/") if path else []
    if not _HOST.fullmatch(host) or not all(_COMPONENT.fullmatch(p) for p in parts):
        raise Refused(f"{name!r} is not a registry host with a repository path")
    return host.lower(), parts


def by_digest(reference: str, digest: str) -> str:
    """``host/repo:tag`` + ``sha256:...`` -> ``host/repo@sha256:...``: what the source pushed, which
    nobody can move (a tag can be replaced in the registry after the push)."""
    if not _DIGEST.fullmatch(digest):
        raise Refused(f"{digest!r} is not a sha256 digest; refusing to restore by tag")
    host, parts = split(reference)
    return f"{reference.partition('/')[0]}/{'/'.join(parts)}@{digest}" if parts else f"{host}@{digest}"


def parse_list(value: str | None) -> tuple[str, ...]:
    return tuple(x.strip().rstrip("/") for x in (value or "").split(",") if x.strip())


@dataclass(frozen=True)
class Policy:
    registries: tuple[str, ...]  # host[/path-prefix] entries; empty: none allowed
    namespaces: frozenset[str] | None = None  # None: every namespace

    @classmethod
    def from_env(cls, env: Mapping[str, str], default_registry: str | None) -> Policy:
        """``PODMIGRATE_ALLOWED_REGISTRIES`` or, absent, the one default registry; ``PODMIGRATE_NAMESPACES``."""
        registries = parse_list(env.get(REGISTRIES_ENV)) or parse_list(default_registry)
        namespaces = parse_list(env.get(NAMESPACES_ENV))
        return cls(registries, frozenset(namespaces) if namespaces else None)

    @classmethod
    def of(cls, registries: Iterable[str], namespaces: Iterable[str] | None = None) -> Policy:
        ns = frozenset(namespaces) if namespaces is not None else None
        return cls(tuple(r.rstrip("/") for r in registries), ns)

    def allows_registry(self, name: str) -> bool:
        try:
            host, parts = split(name)
        except Refused:
            return False
        for entry in self.registries:
            e_host, e_parts = split(entry)
            if host == e_host and parts[: len(e_parts)] == e_parts:
                return True
        return False

    def check_registry(self, name: str, what: str = "registry") -> None:
        if not self.allows_registry(name):
            allowed = ", ".join(self.registries) or "none"
            raise Refused(
                f"{what} {name!r} is not in the allowed registries ({allowed}); checkpoints hold the pod's "
                f"memory and go only where the cluster's admin allows: add it to {REGISTRIES_ENV} "
                "(comma-separated host[:port][/path-prefix]) in the podmigrate-config ConfigMap"
            )

    def check_namespace(self, namespace: str) -> None:
        if self.namespaces is not None and namespace not in self.namespaces:
            raise Refused(
                f"namespace {namespace!r} is not served (served: {', '.join(sorted(self.namespaces))}); "
                f"add it to {NAMESPACES_ENV} in the podmigrate-config ConfigMap"
            )
