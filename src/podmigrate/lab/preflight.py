"""Checks before a lab starts (``lifecycle.up`` runs them): each failure says what is missing and how to get it."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

from podmigrate.errors import PreflightError

MIN_FREE_BYTES = 6 << 30


def kernel_has_checkpoint_restore() -> bool | None:
    """True/False from the kernel config when it can be read; None when it cannot."""
    candidates = [Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")]
    for p in candidates:
        try:
            text = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
        except OSError:
            continue
        return "CONFIG_CHECKPOINT_RESTORE=y" in text
    # without a config: ns_last_pid only exists with CONFIG_CHECKPOINT_RESTORE
    return True if Path("/proc/sys/kernel/ns_last_pid").exists() else None


def check_host(base: Path) -> list[str]:
    """Raise PreflightError on a blocking problem; return notes about things it fixed."""
    notes: list[str] = []
    if os.geteuid() != 0:
        raise PreflightError(
            "podmigrate's lab needs root (namespaces, mounts, CRIU)", hint="run it with sudo or as root"
        )
    if kernel_has_checkpoint_restore() is False:
        raise PreflightError(
            "this kernel was built without CONFIG_CHECKPOINT_RESTORE; CRIU cannot work",
            hint="use a kernel with CONFIG_CHECKPOINT_RESTORE=y",
        )
    for tool in ("unshare", "nsenter", "mount", "umount", "chroot"):
        if not shutil.which(tool):
            raise PreflightError(f"{tool} is missing on the host", hint="apt-get install util-linux")
    if not shutil.which("pivot_root"):
        raise PreflightError("pivot_root is missing on the host", hint="apt-get install util-linux")
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    if free < MIN_FREE_BYTES:
        raise PreflightError(
            f"only {free / 2**30:.1f} GiB free under {base}; the lab needs "
            f"{MIN_FREE_BYTES / 2**30:.0f} GiB (node image + checkpoints)",
            hint="free some space or set PODMIGRATE_HOME to a bigger disk",
        )
    if not shutil.which("debootstrap"):
        p = subprocess.run(["apt-get", "install", "-y", "-q", "debootstrap"], capture_output=True, text=True)
        if p.returncode:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            p = subprocess.run(["apt-get", "install", "-y", "-q", "debootstrap"], capture_output=True, text=True)
        if p.returncode:
            raise PreflightError(
                "debootstrap is missing and could not be installed",
                hint="apt-get install debootstrap",
                details={"output": p.stdout[-2000:] + p.stderr[-2000:]},
            )
        notes.append("installed debootstrap on the host")
    return notes
