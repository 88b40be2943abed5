"""The Podman + runc + CRIU backend of the node agent: ``Podman``, the ``base.Runtime`` the lab's agents drive.

It joins its siblings, each one seam of the backend: ``podman_cli`` (one podman command, failures
explained), ``podman_containers`` (container verbs), ``podman_pod`` (whole pods), ``lazy`` (page
server and post-copy), ``criu_conf`` (CRIU's options file and output); it adds what the node reports
about itself (``info``, ``capabilities``). Standard library only.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podmigrate.runtime import criu_conf, uffd
from podmigrate.runtime.base import NodeCapabilities
from podmigrate.runtime.l2 import PodmanL2
from podmigrate.runtime.lazy import PodmanLazy
from podmigrate.runtime.podman_containers import PodmanContainers
from podmigrate.runtime.podman_pod import PodmanPods

if TYPE_CHECKING:
    from podmigrate.runtime.base import Runtime


# every migration's validate asks both nodes what they run: `podman --version` alone costs ~40 ms of
# CPU, which two lanes of an evacuation on two cores feel. Asked again when the binary changes (path,
# inode, size, mtime) or after this long: an upgrade behind a wrapper script is seen within it
PROBE_TTL_S = 60.0
_probed: dict[tuple[str, ...], tuple[tuple[object, ...], float, str]] = {}


def _binary(name: str) -> tuple[object, ...]:
    path = shutil.which(name)
    if path is None:
        return (name,)
    try:
        st = os.stat(path)
    except OSError:
        return (path,)
    return (path, st.st_ino, st.st_size, st.st_mtime_ns)


def _output(*cmd: str) -> str | None:
    """``cmd``'s standard output, from the last run while its binary is unchanged and fresh (None:
    it could not be run)."""
    key, now = _binary(cmd[0]), time.monotonic()
    seen = _probed.get(cmd)
    if seen and seen[0] == key and now - seen[1] < PROBE_TTL_S:
        return seen[2]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    _probed[cmd] = (key, now, out)
    return out


def _first_line(*cmd: str) -> str:
    out = _output(*cmd)
    if out is None:
        return "missing"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


class Podman(PodmanPods, PodmanLazy, PodmanL2, PodmanContainers):
    def info(self) -> dict[str, Any]:
        caps = self.capabilities()
        return {
            "runtime": caps["runtime"],
            "podman": _first_line("podman", "--version").split()[-1],
            "runc": _first_line("runc", "--version").split()[-1],
            "criu": caps["criu"],
            "lazy_pages": caps["lazy_pages"],
            "soft_dirty": caps["soft_dirty"],
            "capabilities": caps,
        }

    def cpuinfo(self) -> str | None:
        """This node's CPU as CRIU records it (``criu cpuinfo dump``), base64; None if CRIU cannot."""
        if not hasattr(self, "_cpuinfo"):  # the CPU does not change while the agent runs
            with tempfile.TemporaryDirectory() as d:
                argv = ["criu", "cpuinfo", "dump", "-D", d]
                try:
                    ok = subprocess.run(argv, capture_output=True, text=True, timeout=30).returncode == 0
                except (OSError, subprocess.TimeoutExpired):  # no CRIU here: `hosts status` says so
                    ok = False
                img = Path(d) / "cpuinfo.img"
                self._cpuinfo = base64.b64encode(img.read_bytes()).decode() if ok and img.exists() else None
        return self._cpuinfo

    def cpuinfo_check(self, image: str) -> str | None:
        """None when processes dumped on the CPU ``image`` describes can run here; else CRIU's reason."""
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "cpuinfo.img").write_bytes(base64.b64decode(image))
            p = subprocess.run(["criu", "cpuinfo", "check", "-D", d], capture_output=True, text=True, timeout=30)
        if p.returncode == 0:
            return None
        lines = [ln.strip() for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
        return next((ln for ln in lines if "Error" in ln), lines[-1] if lines else f"exit {p.returncode}")

    def capabilities(self) -> NodeCapabilities:
        criu = _first_line("criu", "--version")
        return NodeCapabilities(
            runtime="podman",
            criu=criu.split()[-1] if criu.startswith("Version") else criu,
            lazy_dump_read=criu_conf.has_option("--lazy-dump-mode"),
            lazy_pages=uffd.usable(),
            page_server=criu != "missing",  # every CRIU this backend runs with (>= 4.2) has one
            soft_dirty=False,  # not probed: no pre-dump runs here yet, and False refuses one rather than risk it
            pods=True,
            tcp_established=True,
        )


if TYPE_CHECKING:

    def _conforms(p: Podman) -> Runtime:
        return p  # mypy: Podman has every verb of the protocol, with compatible signatures
