"""The node image's versions (lab.image_store, lab.image) and the host's Debian mirror (lab.mirror),
without a lab or root: the builds are replaced by ``fake_build``, which writes one file."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from podmigrate.errors import LabError
from podmigrate.lab import criu_build, image, mirror
from podmigrate.lab.image_store import MARKER, ImageStore
from podmigrate.workload import image as workload_image

# ---------------------------------------------------------------------------------------- mirror

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian-security/20250520T000000Z
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm

Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Enabled: no

Types: deb
URIs: https://packages.cloud.example/apt
Suites: cloud-sdk-bookworm nodistro
Components: main

Types: deb
# the archive, after a comment line, its suites on two lines
URIs: http://mirror.example/debian/
Suites: bookworm
 bookworm-updates
Components: main
"""

ONE_LINE = """\
# deb http://commented.example/debian bookworm main
deb-src http://src.example/debian bookworm main
deb [signed-by=/usr/share/keyrings/x.gpg] http://security.example/debian-security bookworm-security main
deb [ arch=amd64 signed-by=/k.gpg ] https://packages.cloud.example/apt cloud-sdk-bookworm main
deb [arch=amd64] http://proxy.example:3142/debian trixie main contrib  # the archive
"""


def apt_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    return apt


def test_the_mirror_is_the_first_debian_archive_of_deb822_sources(tmp_path: Path) -> None:
    apt = apt_dir(tmp_path, {"sources.list.d/debian.sources": DEB822})
    assert mirror.find({}, apt) == "http://mirror.example/debian"


def test_the_mirror_is_the_first_debian_archive_of_one_line_sources(tmp_path: Path) -> None:
    apt = apt_dir(tmp_path, {"sources.list": ONE_LINE})
    assert mirror.find({}, apt) == "http://proxy.example:3142/debian"


def test_sources_are_read_in_apts_order_and_only_apts_file_names(tmp_path: Path) -> None:
    apt = apt_dir(
        tmp_path,
        {
            "sources.list": "deb http://first.example/debian-security bookworm-security main\n",
            "sources.list.d/b.list": "deb http://b.example/debian bookworm main\n",
            "sources.list.d/a.sources": "Types: deb\nURIs: http://a.example/debian\nSuites: stable\n",
            "sources.list.d/0.list.disabled": "deb http://disabled.example/debian bookworm main\n",
        },
    )
    assert mirror.find({}, apt) == "http://a.example/debian"


def test_a_local_mirror_list_is_followed(tmp_path: Path) -> None:
    listing = tmp_path / "debian.list"
    listing.write_text("# cloud image mirrors\nhttp://cloud.example/debian\tpriority:1\nhttp://other.example/debian\n")
    sources = f"Types: deb\nURIs: mirror+file://{listing}\nSuites: bookworm bookworm-updates\n"
    apt = apt_dir(tmp_path, {"sources.list.d/debian.sources": sources})
    assert mirror.find({}, apt) == "http://cloud.example/debian"


def test_the_environment_overrides_the_host_sources(tmp_path: Path) -> None:
    apt = apt_dir(tmp_path, {"sources.list.d/debian.sources": DEB822})
    assert mirror.find({mirror.ENV: "http://override.example/debian/"}, apt) == "http://override.example/debian"
    assert mirror.find({mirror.ENV: " "}, apt) == "http://mirror.example/debian"  # blank is unset


def test_no_mirror_found_says_where_it_looked_and_what_to_set(tmp_path: Path) -> None:
    apt = apt_dir(
        tmp_path,
        {
            "sources.list": "deb http://archive.ubuntu.example/ubuntu jammy main\n",
            "sources.list.d/sec.sources": (
                "Types: deb\nURIs: http://m.example/debian-security\nSuites: bookworm-security\n"
            ),
        },
    )
    with pytest.raises(LabError) as e:
        mirror.find({}, apt)
    text = str(e.value)
    assert str(apt / "sources.list") in text and str(apt / "sources.list.d/sec.sources") in text
    assert "PODMIGRATE_MIRROR" in text
    assert any("jammy" in line for line in e.value.details["entries"])
    with pytest.raises(LabError, match=r"no sources\.list"):
        mirror.find({}, tmp_path / "no-apt-here")


def test_no_mirror_host_is_named_in_the_code() -> None:
    root = Path(__file__).resolve().parents[1]
    files = [*(root / "src").rglob("*.py"), *(root / "scripts").iterdir()]
    named = [str(f) for f in files if f.is_file() and "deb.debian.org" in f.read_text(errors="replace")]
    assert named == []


# ----------------------------------------------------------------------------------- image store


def fake_build(log: Path, delay: float = 0.0, fail: bool = False) -> Any:
    """A build that writes one file into the rootfs (and counts itself in ``log``), or fails half-way."""

    def build(root: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {root}\n")
        (root / "half").write_text("written before the failure")
        time.sleep(delay)
        if fail:
            raise LabError("the fake build failed")
        (root / "etc").mkdir()
        (root / "etc/os-release").write_text("fake\n")

    return build


def store_at(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "node-image", tmp_path / "labs", lambda d: 1 if (d / "up").exists() else None)


def lab_on(tmp_path: Path, name: str, image_dir: Path | None, up: bool = True) -> Path:
    d = tmp_path / "labs" / name
    d.mkdir(parents=True)
    (d / "lab.json").write_text(json.dumps({"name": name, **({"image": str(image_dir)} if image_dir else {})}))
    if up:
        (d / "up").write_text("")
    return d


def test_two_threads_build_once_and_see_the_same_ready_image(tmp_path: Path) -> None:
    store, log = store_at(tmp_path), tmp_path / "builds"
    got: list[Path] = []
    threads = [
        threading.Thread(target=lambda: got.append(store.ensure("a" * 16, fake_build(log, 0.3), print)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(log.read_text().splitlines()) == 1
    assert got == [store.rootfs("a" * 16)] * 2 and store.ready("a" * 16)
    assert (got[0] / "etc/os-release").read_text() == "fake\n"
    assert sorted(p.name for p in store.path.iterdir()) == [".lock", "a" * 16]


def _ensure_in_child(tmp_path: Path, log: Path) -> None:
    print(store_at(tmp_path).ensure("b" * 16, fake_build(log, 0.3), lambda _m: None))


def test_two_processes_build_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    log = tmp_path / "builds"
    children = [ctx.Process(target=_ensure_in_child, args=(tmp_path, log)) for _ in range(2)]
    for c in children:
        c.start()
    for c in children:
        c.join(30)
    assert [c.exitcode for c in children] == [0, 0]
    assert len(log.read_text().splitlines()) == 1 and store_at(tmp_path).ready("b" * 16)


def test_a_failed_build_leaves_no_half_directory_and_the_next_one_starts_fresh(tmp_path: Path) -> None:
    store, log = store_at(tmp_path), tmp_path / "builds"
    with pytest.raises(LabError, match="fake build failed"):
        store.ensure("c" * 16, fake_build(log, fail=True), print)
    assert sorted(p.name for p in store.path.iterdir()) == [".lock"]
    assert not store.ready("c" * 16)
    # a builder killed half-way leaves its temporary directory: the next builder removes it
    (store.path / ".build-cccccccccccccccc-dead").mkdir()
    (store.path / ".build-cccccccccccccccc-dead/rootfs").mkdir()
    root = store.ensure("c" * 16, fake_build(log), print)
    assert (root / "etc/os-release").exists() and (root / MARKER).read_text() == "c" * 16
    assert sorted(p.name for p in store.path.iterdir()) == [".lock", "c" * 16]


def test_an_old_version_stays_while_a_lab_that_is_up_uses_it(tmp_path: Path) -> None:
    store, log = store_at(tmp_path), tmp_path / "builds"
    old = store.ensure("1" * 16, fake_build(log), print)
    new = store.ensure("2" * 16, fake_build(log), print)
    lab = lab_on(tmp_path, "a", old)
    lab_on(tmp_path, "b", old, up=False)  # down: its lab.json holds nothing
    assert store.collect("2" * 16, print, grace=0) == [] and store.ready("1" * 16)
    with store.use():  # a lab is starting: nothing is removed, whatever it is about to use
        (lab / "up").unlink()
        assert store.collect("2" * 16, print, grace=0) == []
    with store._lock(".lock"):  # a build is running (held exclusively): its builder sweeps the store
        assert store.collect("2" * 16, print, grace=0) == []
    assert store.collect("2" * 16, print) == []  # used a moment ago: kept for the grace period
    assert store.collect("2" * 16, print, grace=0) == ["1" * 16]
    assert not old.exists() and new.is_dir() and store.versions() == ["2" * 16]
    assert not list(store.path.glob(".trash-*"))


def test_a_lab_from_before_versions_holds_the_old_layouts_image(tmp_path: Path) -> None:
    store, log = store_at(tmp_path), tmp_path / "builds"
    legacy = store.path / "rootfs"
    legacy.mkdir(parents=True)
    (legacy / MARKER).write_text("old-hash")
    lab_on(tmp_path, "default", None)  # up, lab.json without "image"
    finished: list[Path] = []
    root = store.ensure("d" * 16, fake_build(log), print, adopt=("old-hash", finished.append))
    assert finished == [] and legacy.is_dir(), "adopted from under a running lab"
    assert log.read_text() and root == store.rootfs("d" * 16)


def test_the_old_layouts_image_is_adopted_when_no_lab_is_up_on_it(tmp_path: Path) -> None:
    store, log = store_at(tmp_path), tmp_path / "builds"
    legacy = store.path / "rootfs"
    (legacy / "usr/bin").mkdir(parents=True)
    (legacy / "usr/bin/apt-get").write_text("")
    (legacy / MARKER).write_text("old-hash")
    lab_on(tmp_path, "default", None, up=False)
    said: list[str] = []

    def finish_fails(root: Path) -> None:
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space"):
        store.ensure("e" * 16, fake_build(log), said.append, adopt=("old-hash", finish_fails))
    assert (legacy / MARKER).read_text() == "old-hash" and not list(store.path.glob(".build-*"))
    root = store.ensure("e" * 16, fake_build(log), said.append, adopt=("other-hash", lambda r: None))
    assert log.read_text() and legacy.is_dir()  # another spec's: not taken, not touched
    log.unlink()
    root = store.ensure("f" * 16, fake_build(log), said.append, adopt=("old-hash", image.prepare_mount_points))
    assert not log.exists() and not legacy.exists() and (root / "usr/bin/apt-get").exists()
    assert (root / MARKER).read_text() == "f" * 16 and all((root / f).is_file() for f in image.MOUNT_FILES)
    assert any("adopting" in m for m in said)


# ------------------------------------------------------------------------------ the node image


@pytest.fixture
def node_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> image.NodeImage:
    monkeypatch.setattr(mirror, "debian_mirror", lambda: "http://mirror.example/debian")
    img = image.NodeImage(tmp_path / "node-image" / "rootfs")
    monkeypatch.setattr(image.NodeImage, "_build", lambda self, root, report: image.prepare_mount_points(root))
    return img


def test_a_lab_writes_its_configuration_into_its_own_directory_never_into_the_image(
    node_image: image.NodeImage, tmp_path: Path
) -> None:
    root = node_image.ensure(print)
    assert root == node_image.root == node_image.store.rootfs(image.spec_hash()) and node_image.ready()
    before = {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}
    files = node_image.stage_config(tmp_path / "labs/x/image-config")
    assert sorted(files) == sorted(image.MOUNT_FILES)
    for f in files:  # every file a lab mounts has its placeholder in the image
        assert (root / f).is_file() and (tmp_path / "labs/x/image-config" / f).stat().st_size > 0
    assert (tmp_path / "labs/x/image-config/etc/criu/runc.conf").read_text() == image.CRIU_RUNC_CONF
    conf = tmp_path / "labs/x/image-config/etc/containers/containers.conf"
    assert 'firewall_driver = "none"' in conf.read_text()
    node_image.stage_config(tmp_path / "labs/x/image-config", firewall="nftables")  # a lab used as hosts
    assert 'firewall_driver = "nftables"' in conf.read_text() and '"none"' not in conf.read_text()
    after = {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}
    assert after == before
    assert not any((root / f).exists() for f in image.CRIU_CONF_DROPPED)


def test_the_version_follows_the_mirror_and_the_mount_points(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mirror, "debian_mirror", lambda: "http://a.example/debian")
    first, packages = image.spec_hash(), image.packages_hash()
    monkeypatch.setattr(image, "MOUNT_FILES", (*image.MOUNT_FILES, "etc/new.conf"))
    assert image.spec_hash() != first and image.packages_hash() == packages
    monkeypatch.setattr(mirror, "debian_mirror", lambda: "http://b.example/debian")
    assert image.packages_hash() != packages


# ------------------------------------------------------------------------- caches' temporary names


def test_criu_builds_each_work_in_a_directory_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, root = tmp_path / "criu", tmp_path / "rootfs"
    cache.mkdir()
    (cache / "criu-build-crashed").mkdir()  # a killed build's
    orig = cache / criu_build.ORIG
    orig.write_bytes(b"source")
    monkeypatch.setattr(criu_build, "fetch", lambda c, m: orig)
    works: list[Path] = []

    def run(argv: list[str], step: str) -> None:
        work = Path(argv[-1].split("upperdir=")[1].split("/upper")[0])
        works.append(work)
        assert work.parent == cache and (work / "upper/build" / criu_build.ORIG).exists()
        binary = work / f"upper/build/criu-{criu_build.VERSION}/criu/criu"
        binary.parent.mkdir(parents=True)
        binary.write_text("criu")

    criu_build.build(root, cache, "http://mirror.example/debian", run)
    criu_build.build(root, cache, "http://mirror.example/debian", run)
    assert len(set(works)) == 2 and criu_build.installed(root)
    assert sorted(p.name for p in cache.iterdir()) == [".lock", criu_build.ORIG]


def test_workload_cache_entries_get_unique_temporary_names_and_the_first_complete_one_stays(tmp_path: Path) -> None:
    names = {workload_image._part_name("/c/stream-server-x.oci.tar") for _ in range(50)}
    assert len(names) == 50 and all(n.startswith("/c/stream-server-x.oci.tar.") for n in names)
    dest = tmp_path / "workload-rootfs.tar"
    mine, theirs = tmp_path / "a.part", tmp_path / "b.part"
    for d in (mine, theirs):
        (d / "etc").mkdir(parents=True)
        (d / "etc/who").write_text(d.name)
    workload_image._publish(theirs, dest)
    workload_image._publish(mine, dest)  # a directory cannot replace theirs: ours is spare
    workload_image._discard(mine)
    assert (dest / "etc/who").read_text() == "b.part" and sorted(p.name for p in tmp_path.iterdir()) == [dest.name]
