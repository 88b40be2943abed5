"""The one rule for the names that reach a runtime, a file name or an nft script (standard library only).

Checked where requests enter (the CLI, the engine's validate, every agent route), so that nothing
a user or a peer sends can turn into an option (``--all``), a path (``../``) or a script line.
"""

from __future__ import annotations

import ipaddress
import re

from podmigrate.errors import UsageError

# podman's (and Docker's) rule for container and pod names; it also covers IDs and checkpoint ids
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,252}$")
# an image reference: [host[:port]/]path[:tag][@sha256:hex] (distribution's grammar, lower-case paths)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"^(?:[A-Za-z0-9.-]+(?::[0-9]{{1,5}})?/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
_IMAGE_ID = re.compile(r"^(?:sha256:)?[0-9a-f]{12,64}$")


def is_name(value: object) -> bool:
    return isinstance(value, str) and bool(_NAME.fullmatch(value))


def name(value: object, what: str = "container name") -> str:
    """``value`` if it is a valid container/pod name, else a UsageError saying what is allowed."""
    if not is_name(value):
        raise UsageError(
            f"not a valid {what}: {value!r}",
            hint="a name starts with a letter or digit and holds only letters, digits, '_', '.' and '-'",
        )
    return str(value)


def image(value: object) -> str:
    """An image reference or image ID, never anything a command line would read as an option."""
    if not isinstance(value, str) or not (_REFERENCE.fullmatch(value) or _IMAGE_ID.fullmatch(value)):
        raise UsageError(f"not a valid image reference: {value!r}", hint="for example localhost/stream-server:latest")
    return value


def ipv4(value: object) -> str:
    """A single IPv4 address in its canonical form (what goes into an nft script or a route)."""
    try:
        return str(ipaddress.IPv4Address(str(value)))
    except ValueError:
        raise UsageError(f"not an IPv4 address: {value!r}") from None


def port(value: object) -> int:
    """A TCP port number, 1-65535 (an int or its decimal string, nothing else)."""
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdecimal():
        raise UsageError(f"not a port number: {value!r}")
    n = int(value)
    if not 1 <= n <= 65535:
        raise UsageError(f"port {n} is outside 1-65535")
    return n
