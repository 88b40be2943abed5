"""Versions of the node image side by side, each built once and never written again.

A version lives in ``<store>/<version>/rootfs`` (``<version>``: the image's spec hash). It is built by
one process at a time (an exclusive ``flock`` on ``<store>/.lock``) into a fresh directory with a
unique name, its marker is written last, and the whole directory is renamed into place: a reader
sees a complete image or none, a second builder waiting on the lock finds it ready, and a failed
build leaves nothing a later one could mistake for an image.

Labs run on a version with ``/`` bind-mounted from it, so a version is removed only when no lab that
is up uses it (``lab.json``'s ``image``). A lab that is starting holds ``<store>/.use.lock`` shared
from the moment it picks a version until it is up; removal takes that lock exclusively without
waiting and skips when it is busy, so it never removes an image a lab is about to use.

The old layout kept one image in ``<store>/rootfs``, rebuilt in place; ``adopt`` moves such an image
into the new layout when its marker says it is the wanted build and no lab is up on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from podmigrate import filelock
from podmigrate.errors import LabError
from podmigrate.lab.host import Report

MARKER = ".podmigrate-image"
VERSION = re.compile(r"^[0-9a-f]{16}$")
LEGACY = "rootfs"  # the old layout's one image
GRACE = 24 * 3600.0  # an unused version stays this long after its last use: two checkouts of
# different versions sharing one home then do not rebuild each other's image at every `lab up`

Build = Callable[[Path], None]  # fills the given (empty) rootfs directory, or raises
IsUp = Callable[[Path], object]  # a lab's state directory -> its holder pid when up, else None


class ImageStore:
    def __init__(self, path: Path, labs: Path, is_up: IsUp):
        self.path = path
        self.labs = labs
        self.is_up = is_up

    # ------------------------------------------------------------------ reading
    def rootfs(self, version: str) -> Path:
        return self.path / version / "rootfs"

    def ready(self, version: str) -> bool:
        return _marker(self.rootfs(version)) == version

    def versions(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if VERSION.fullmatch(p.name) and p.is_dir())

    def in_use(self) -> set[Path]:
        """The image directories of the labs that are up (a lab from before ``image`` uses the legacy one)."""
        used: set[Path] = set()
        if not self.labs.is_dir():
            return used
        for d in self.labs.iterdir():
            if not d.is_dir() or self.is_up(d) is None:
                continue
            try:
                image = json.loads((d / "lab.json").read_text()).get("image")
            except (OSError, ValueError):
                image = None
            used.add(Path(image) if image else self.path / LEGACY)
        return used

    # ------------------------------------------------------------------ building
    def ensure(self, version: str, build: Build, report: Report, adopt: tuple[str, Build] | None = None) -> Path:
        """``version``'s rootfs, built by ``build`` unless it is ready. ``adopt``: the marker an
        old-layout image must have to be taken as this version instead, and its last step."""
        if self.ready(version):
            return self.rootfs(version)
        self.path.mkdir(parents=True, exist_ok=True)
        with self._lock(".lock"):
            if self.ready(version):  # built by the process that held the lock before us
                return self.rootfs(version)
            self._sweep()
            self._clear(version)
            if adopt is not None and self._adopt(version, *adopt, report):
                return self.rootfs(version)
            tmp = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=self.path))
            try:
                tmp.chmod(0o755)  # mkdtemp's 0700 would stay on the published version
                root = tmp / "rootfs"
                root.mkdir()
                build(root)
                (root / MARKER).write_text(version)
                os.rename(tmp, self.path / version)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return self.rootfs(version)

    def _adopt(self, version: str, legacy_marker: str, finish: Build, report: Report) -> bool:
        """Move the old layout's image into ``version`` if it is that build and no lab is up on it.

        ``finish`` then runs on it as on a fresh build's last step (the new layout's mount points)."""
        old = self.path / LEGACY
        if _marker(old) != legacy_marker or old in self.in_use():
            return False
        report(f"adopting the node image in {old} as version {version}")
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=self.path))
        tmp.chmod(0o755)
        os.rename(old, tmp / "rootfs")
        try:
            finish(tmp / "rootfs")
            (tmp / "rootfs" / MARKER).write_text(version)
            os.rename(tmp, self.path / version)
        except BaseException:
            os.rename(tmp / "rootfs", old)  # left as it was found: a failed adoption loses no image
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True

    def _sweep(self) -> None:
        """Remove what crashed builders and removals left (under the build lock: none is running)."""
        for p in self.path.glob(".build-*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.path.glob(".trash-*"):
            shutil.rmtree(p, ignore_errors=True)

    def _clear(self, version: str) -> None:
        """A directory named ``version`` that is not a ready image (damaged by hand) is removed, if unused."""
        d = self.path / version
        if not d.exists():
            return
        if self.rootfs(version) in self.in_use():
            raise LabError(
                f"the node image {d} is damaged (no marker) and a lab is up on it",
                hint="take the labs on it down (`podmigrate lab down`), then `lab up` again",
            )
        self._remove(d)

    # ------------------------------------------------------------------ using and removing
    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Held from picking a version until the lab on it is up: removal waits for none of it."""
        self.path.mkdir(parents=True, exist_ok=True)
        with self._lock(".use.lock", shared=True):
            yield

    def touch(self, version: str) -> None:
        """Record a use of ``version`` (beside it: nothing is written inside a built image)."""
        (self.path / f"{version}.used").touch()

    def collect(self, keep: str, report: Report, grace: float = GRACE) -> list[str]:
        """Remove every version but ``keep`` that no lab up uses and none used for ``grace`` seconds.

        Skipped (returns []) while a lab is starting, since it may be about to use one of them, and
        while an image is being built (its builder sweeps the store)."""
        removed: list[str] = []
        with (
            self._lock(".use.lock", wait=False) as unused,
            self._lock(".lock", wait=False) as idle,
        ):
            if not (unused and idle):
                return removed
            used = self.in_use()
            now = time.time()
            for v in self.versions():
                if v == keep or self.rootfs(v) in used or now - self._last_use(v) < grace:
                    continue
                report(f"removing the node image {self.path / v}: no lab uses it")
                self._remove(self.path / v)
                (self.path / f"{v}.used").unlink(missing_ok=True)
                removed.append(v)
        return removed

    def _last_use(self, version: str) -> float:
        times = [0.0]
        for p in (self.path / f"{version}.used", self.rootfs(version) / MARKER):
            with contextlib.suppress(OSError):
                times.append(p.stat().st_mtime)
        return max(times)

    def _remove(self, d: Path) -> None:
        # renamed first, so that no reader ever finds a half-removed image under its name
        trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=self.path))
        os.rename(d, trash / d.name)
        shutil.rmtree(trash, ignore_errors=True)

    def _lock(self, name: str, shared: bool = False, wait: bool = True) -> contextlib.AbstractContextManager[bool]:
        """flock ``name`` in the store (``filelock.held``): False when not ``wait``-ing and busy."""
        return filelock.held(self.path / name, shared=shared, wait=wait, mode=0o644)


def _marker(root: Path) -> str | None:
    try:
        return (root / MARKER).read_text().strip()
    except OSError:
        return None
