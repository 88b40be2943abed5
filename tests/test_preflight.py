"""Preflight refuses a machine that cannot run the lab, saying what is missing and what to do."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from podmigrate.errors import PreflightError
from podmigrate.lab import preflight

Usage = namedtuple("Usage", "total used free")


def test_not_root_is_refused(monkeypatch, tmp_path: Path):
    monkeypatch.setattr("podmigrate.lab.preflight.os.geteuid", lambda: 1000)
    with pytest.raises(PreflightError, match="needs root") as e:
        preflight.check_host(tmp_path)
    assert "sudo" in str(e.value)


def test_kernel_without_checkpoint_restore_is_refused(monkeypatch, tmp_path: Path):
    monkeypatch.setattr("podmigrate.lab.preflight.os.geteuid", lambda: 0)
    monkeypatch.setattr(preflight, "kernel_has_checkpoint_restore", lambda: False)
    with pytest.raises(PreflightError, match="CONFIG_CHECKPOINT_RESTORE"):
        preflight.check_host(tmp_path)


def test_too_little_disk_is_refused_with_the_numbers(monkeypatch, tmp_path: Path):
    monkeypatch.setattr("podmigrate.lab.preflight.os.geteuid", lambda: 0)
    monkeypatch.setattr(preflight, "kernel_has_checkpoint_restore", lambda: True)
    monkeypatch.setattr("podmigrate.lab.preflight.shutil.disk_usage", lambda _p: Usage(10 << 30, 9 << 30, 1 << 30))
    with pytest.raises(PreflightError, match=r"only 1\.0 GiB free") as e:
        preflight.check_host(tmp_path)
    assert "PODMIGRATE_HOME" in str(e.value)


def test_missing_debootstrap_is_installed(monkeypatch, tmp_path: Path):
    calls = []
    monkeypatch.setattr("podmigrate.lab.preflight.os.geteuid", lambda: 0)
    monkeypatch.setattr(preflight, "kernel_has_checkpoint_restore", lambda: True)
    monkeypatch.setattr("podmigrate.lab.preflight.shutil.disk_usage", lambda _p: Usage(100 << 30, 0, 100 << 30))
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(
        "podmigrate.lab.preflight.shutil.which", lambda t: None if t == "debootstrap" else real_which(t)
    )

    class Done:
        returncode = 0
        stdout = stderr = ""

    def fake_run(argv, **kw):
        calls.append(argv)
        return Done()

    monkeypatch.setattr("podmigrate.lab.preflight.subprocess.run", fake_run)
    assert preflight.check_host(tmp_path) == ["installed debootstrap on the host"]
    assert calls == [["apt-get", "install", "-y", "-q", "debootstrap"]]


def test_this_kernel_supports_checkpoint_restore():
    assert preflight.kernel_has_checkpoint_restore() in (True, None)
