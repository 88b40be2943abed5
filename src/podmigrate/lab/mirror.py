"""The Debian mirror the node image, podmigrate's CRIU source and the workload image come from.

``PODMIGRATE_MIRROR`` when set; else the first Debian archive the host's apt already uses, read from
its sources in either format: deb822 (``/etc/apt/sources.list.d/*.sources``: ``Types``, ``URIs``,
``Suites``) or one-line (``/etc/apt/sources.list``, ``sources.list.d/*.list``:
``deb [options] URI suite components``). A user behind their own mirror or proxy then builds
through it with nothing to configure, and no mirror's name is written in podmigrate.

Standard library only: ``scripts/k8s-tools`` runs it as ``python3 -m podmigrate.lab.mirror`` from
the checkout, before the virtualenv exists; it prints the mirror, or the error and exits 1.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from podmigrate.errors import LabError

ENV = "PODMIGRATE_MIRROR"
APT = Path("/etc/apt")
# A suite is Debian's when its first word is a release name or alias (bookworm, bookworm-updates,
# bookworm-backports, stable-proposed-updates, sid): a third-party repository that only mentions a
# release inside its own suite name (cloud-sdk-bookworm) or has its own (nodistro) is not an archive.
DEBIAN_SUITES = frozenset(
    [
        "jessie",
        "stretch",
        "buster",
        "bullseye",
        "bookworm",
        "trixie",
        "forky",
        "duke",
        "sid",
        "oldoldstable",
        "oldstable",
        "stable",
        "testing",
        "unstable",
        "experimental",
    ]
)
# what debootstrap and urllib can fetch from; mirror+file: lists are read below, cdrom: and tor+ skipped
SCHEMES = ("http://", "https://", "ftp://", "file:")


@dataclass(frozen=True)
class Source:
    """One apt source entry (a one-line ``deb`` line, or one URI of a deb822 stanza)."""

    uri: str
    suites: tuple[str, ...]
    origin: str  # file:line, for the error that lists what was looked at


def parse_deb822(text: str, origin: str) -> list[Source]:
    """The ``deb`` entries of a deb822 ``.sources`` file (stanzas split by blank lines)."""
    out: list[Source] = []
    for start, stanza in _stanzas(text):
        if stanza.get("enabled", "yes").lower() == "no" or "deb" not in stanza.get("types", "").split():
            continue
        suites = tuple(stanza.get("suites", "").split())
        out += [Source(uri, suites, f"{origin}:{start}") for uri in stanza.get("uris", "").split()]
    return out


def _stanzas(text: str) -> Iterator[tuple[int, dict[str, str]]]:
    fields: dict[str, str] = {}
    key = ""
    start = 0
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield start, fields
            fields, key = {}, ""
            continue
        if line[0] in " \t" and key:  # a continuation line (multi-line URIs or Suites)
            fields[key] += " " + line.strip()
            continue
        name, sep, value = line.partition(":")
        if sep:
            if not fields:
                start = n
            key = name.strip().lower()
            fields[key] = value.strip()


def parse_one_line(text: str, origin: str) -> list[Source]:
    """The ``deb`` lines of a one-line ``sources.list`` (``deb [opt=v ...] URI suite [components]``)."""
    out: list[Source] = []
    for n, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # options, which may hold spaces: "[ arch=amd64 ]"
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 2:
            out.append(Source(words[0], (words[1],), f"{origin}:{n}"))
    return out


def source_files(apt: Path = APT) -> list[Path]:
    """The files apt reads, in its order: sources.list, then sources.list.d's parts by name."""
    parts = apt / "sources.list.d"
    found = sorted(p for p in parts.glob("*") if p.suffix in (".list", ".sources")) if parts.is_dir() else []
    main = apt / "sources.list"
    return [main, *found] if main.is_file() else found


def sources(apt: Path = APT) -> list[Source]:
    out: list[Source] = []
    for f in source_files(apt):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        out += parse_deb822(text, str(f)) if f.suffix == ".sources" else parse_one_line(text, str(f))
    return out


def is_debian_archive(src: Source) -> bool:
    """Debian's main archive: a Debian suite, and neither the URI nor the suite is the security one."""
    if "security" in src.uri:
        return False
    return any("security" not in s and s.split("/")[0].split("-")[0] in DEBIAN_SUITES for s in src.suites)


def usable_uri(uri: str) -> str | None:
    """``uri`` as a mirror to download from, or None when it cannot be one (cdrom:, tor+, a remote list)."""
    if uri.startswith("mirror+file:"):
        # apt's mirror method with a local list (Debian's cloud images): its first entry
        path = uri.removeprefix("mirror+file:").removeprefix("//")
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            return None
        entries = [ln.split()[0] for ln in lines if ln.strip() and not ln.startswith("#")]
        return usable_uri(entries[0]) if entries else None
    if uri.startswith(SCHEMES):
        return uri.rstrip("/")
    return None


def find(env: Mapping[str, str] | None = None, apt: Path = APT) -> str:
    """The mirror: ``$PODMIGRATE_MIRROR``, else the first Debian archive in the host's apt sources."""
    env = os.environ if env is None else env
    if env.get(ENV, "").strip():
        return env[ENV].strip().rstrip("/")
    looked = source_files(apt)
    seen: list[str] = []
    for src in sources(apt):
        seen.append(f"{src.origin}: {src.uri} {' '.join(src.suites)}")
        uri = usable_uri(src.uri) if is_debian_archive(src) else None
        if uri:
            return uri
    where = ", ".join(str(p) for p in looked) or f"no sources.list or sources.list.d/*.list|*.sources under {apt}"
    raise LabError(
        f"no Debian archive found in the host's apt sources (looked at: {where})",
        hint=f"set {ENV} to a Debian mirror, e.g. {ENV}=http://<your mirror>/debian",
        details={"entries": seen},
    )


@functools.cache
def debian_mirror() -> str:
    """``find()`` once per process: every image key and build in it uses the same mirror."""
    return find()


def main() -> int:
    try:
        print(find())
    except LabError as e:
        print(f"podmigrate: {e}", file=sys.stderr)
        for line in e.details.get("entries", []):
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
