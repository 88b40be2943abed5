"""``podmigrate hosts install-agent BUNDLE``: on a host, its node agent as a systemd service, from
the installed package.

The bundle ``hosts init`` made for this host goes to ``/etc/podmigrate`` (its key 0600, the directory
0700); the unit ``podmigrate-agent.service`` runs this package's Python on ``podmigrate.agent.server``
with the bundle's arguments, restarted when it fails; systemd enables and starts it. ``root`` writes
under another root and starts nothing (an image being built, the tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from podmigrate.errors import UsageError

FILES = {"ca.crt": 0o644, "agent.crt": 0o644, "agent.key": 0o600, "agent.env": 0o600}
UNIT_NAME = "podmigrate-agent.service"
UNIT = """[Unit]
Description=podmigrate node agent: live migration of this host's containers (docs/hosts.md)
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
EnvironmentFile={etc}/agent.env
ExecStart={python} -m podmigrate.agent.server $PODMIGRATE_AGENT_ARGS
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
"""


def install(bundle: Path, root: Path = Path("/"), start: bool = True) -> dict[str, str]:
    """Where the bundle and the unit went; with ``start``, the agent enabled and started."""
    missing = [f for f in FILES if not (bundle / f).is_file()]
    if missing:
        raise UsageError(
            f"{bundle} is not a host's bundle: {', '.join(missing)} missing",
            hint="give the directory `podmigrate hosts init` made for this host (<state>/bundles/HOST)",
        )
    etc = root / "etc" / "podmigrate"
    etc.mkdir(parents=True, exist_ok=True)
    os.chmod(etc, 0o700)  # the agent's key
    for name, mode in FILES.items():
        tmp = etc / f".{name}.new"
        shutil.copyfile(bundle / name, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, etc / name)
    unit = root / "etc" / "systemd" / "system" / UNIT_NAME
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(UNIT.format(etc="/etc/podmigrate", python=sys.executable))
    if start and root == Path("/"):
        for argv in (["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", UNIT_NAME],
                     ["systemctl", "restart", UNIT_NAME]):  # fmt: skip
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode:
                raise UsageError(f"{' '.join(argv)} failed: {p.stderr.strip()}",
                                 hint=f"the files are in place; see journalctl -u {UNIT_NAME}")  # fmt: skip
    return {"etc": str(etc), "unit": str(unit)}
