"""runtime.prefetch and agent.node_prefetch: CRIU's pagemap images read and written, the mappings
chosen, lazy pages made present from a live process's memory (this test's own), the source's send
and the target's pre-restore script (run by sh as CRIU would), without a lab."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from podmigrate.agent import node_prefetch
from podmigrate.agent.checkpoints import CheckpointDir
from podmigrate.agent.node_prefetch import Prefetches
from podmigrate.runtime import prefetch
from podmigrate.runtime.prefetch import PAGE, PE_LAZY, PE_PARENT, PE_PRESENT, Entry
from podmigrate.transport.stream import Seal

MAGIC = struct.pack("<II", 0x54564319, 0x56084025)  # IMG_COMMON_MAGIC, PAGEMAP_MAGIC


def test_a_pagemap_image_reads_back_as_written_and_in_criu_s_encoding(tmp_path: Path) -> None:
    entries = [Entry(0x400000, 3, PE_PRESENT), Entry(0x7F0000000000, 262144, PE_LAZY), Entry(0x7FFF0000, 1, PE_PARENT)]
    img = tmp_path / "pagemap-1.img"
    img.write_bytes(prefetch.encode_pagemap(MAGIC, 7, entries))
    assert prefetch.read_pagemap(img) == (MAGIC, 7, entries)
    data = img.read_bytes()
    # the head: length 2, field 1 = 7; the first entry: vaddr, compat_nr_pages 0, flags, nr_pages
    assert data[8:14] == b"\x02\x00\x00\x00\x08\x07"
    assert data[18:].startswith(b"\x08\x80\x80\x80\x02\x10\x00\x20\x04\x28\x03")


def test_an_old_criu_s_entry_without_flags_or_nr_pages_is_present_with_its_compat_count(tmp_path: Path) -> None:
    body = b"\x08\x80\x20\x10\x05"  # vaddr 0x1000, compat_nr_pages 5
    img = tmp_path / "pagemap-1.img"
    img.write_bytes(MAGIC + b"\x02\x00\x00\x00\x08\x01" + struct.pack("<I", len(body)) + body)
    assert prefetch.read_pagemap(img)[2] == [Entry(0x1000, 5, PE_PRESENT)]
    img.write_bytes(MAGIC + b"\x02\x00\x00\x00\x08\x01" + b"\x03\x00\x00\x00\x0a\x01\x00")  # a length-delimited field
    with pytest.raises(ValueError, match="wire type 2"):
        prefetch.read_pagemap(img)


def test_the_smallest_mappings_are_chosen_while_they_fit_and_the_heap_stays_lazy() -> None:
    maps = [(0x10000, 0x20000), (0x20000, 0x28000), (0x40000, 0x44000), (0x100000, 0x4100000)]
    entries = [
        Entry(0x1000, 2, PE_PRESENT),  # present already: never counted
        Entry(0x10000, 24, PE_LAZY),  # one entry across two mappings: 16 pages and 8
        Entry(0x40000, 4, PE_LAZY),
        Entry(0x100000, 16384, PE_LAZY),  # a 64 MB heap
    ]
    assert prefetch.choose(entries, maps, 12 * PAGE) == [(0x20000, 0x28000), (0x40000, 0x44000)]
    assert prefetch.choose(entries, maps, 28 * PAGE) == [(0x10000, 0x20000), (0x20000, 0x28000), (0x40000, 0x44000)]
    assert prefetch.choose(entries, maps, 3 * PAGE) == []


def test_an_entry_is_cut_at_the_edges_of_the_chosen_ranges() -> None:
    e = Entry(0x10000, 16, PE_LAZY)
    assert prefetch.split(e, [(0x14000, 0x18000)]) == [
        (Entry(0x10000, 4, PE_LAZY), False),
        (Entry(0x14000, 4, PE_LAZY), True),
        (Entry(0x18000, 8, PE_LAZY), False),
    ]
    assert prefetch.split(e, [(0x0, 0x100000)]) == [(e, True)]
    assert prefetch.split(e, [(0x30000, 0x40000)]) == [(e, False)]


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _images(tmp_path: Path, vpid: int, region: int, pages: int) -> tuple[Path, bytes]:
    """A dump's images for one task: one present page (in pages-3.img), then ``pages`` lazy pages
    at ``region``."""
    images = tmp_path / "checkpoint"
    images.mkdir()
    present = b"P" * PAGE
    (images / "pages-3.img").write_bytes(present)
    entries = [Entry(0x1000, 1, PE_PRESENT), Entry(region, pages, PE_LAZY)]
    (images / f"pagemap-{vpid}.img").write_bytes(prefetch.encode_pagemap(MAGIC, 3, entries))
    return images, present


def test_lazy_pages_of_a_live_process_become_present_in_its_images(tmp_path: Path) -> None:
    buf = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    heap = os.urandom(8 * PAGE)
    buf[:] = heap
    region = _address(buf)
    pid = os.getpid()
    images, present = _images(tmp_path, pid, region, 8)
    before = {p.name: p.read_bytes() for p in images.iterdir()}

    # a budget too small for the mapping: nothing is rewritten
    got = prefetch.pull_hot_pages(images, pid, 4 * PAGE)
    assert got["bytes"] == 0 and {p.name: p.read_bytes() for p in images.iterdir()} == before

    got = prefetch.pull_hot_pages(images, pid, 1 << 20)
    assert got["bytes"] == 8 * PAGE and got["mappings"] == 1
    _, pages_id, entries = prefetch.read_pagemap(images / f"pagemap-{pid}.img")
    assert pages_id == 3 and entries == [Entry(0x1000, 1, PE_PRESENT), Entry(region, 8, PE_PRESENT)]
    # the present page first, then the heap as the process holds it, in entry order
    assert (images / "pages-3.img").read_bytes() == present + heap
    assert sorted(p.name for p in images.iterdir()) == sorted(["pages-3.img", f"pagemap-{pid}.img"])
    assert {p.stat().st_mode & 0o777 for p in images.iterdir()} == {0o600}  # process memory: the owner's alone
    buf.close()


def test_a_read_that_fails_leaves_the_images_as_they_were(tmp_path: Path) -> None:
    buf = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region = _address(buf)
    pid = os.getpid()
    # the pagemap claims 4 present pages, the pages file holds 1: the copy is short, nothing replaced
    images, _ = _images(tmp_path, pid, region, 4)
    (images / f"pagemap-{pid}.img").write_bytes(
        prefetch.encode_pagemap(MAGIC, 3, [Entry(0x1000, 4, PE_PRESENT), Entry(region, 4, PE_LAZY)])
    )
    before = {p.name: p.read_bytes() for p in images.iterdir()}
    with pytest.raises(ValueError, match="short read of 4 pages"):
        prefetch.pull_hot_pages(images, pid, 1 << 20)
    assert {p.name: p.read_bytes() for p in images.iterdir()} == before
    buf.close()


def _run_script(text: str, podman: Path, action: str = "pre-restore") -> subprocess.CompletedProcess[str]:
    script = podman.parent / "action.sh"
    script.write_text(text)
    script.chmod(0o700)
    env = {"PATH": os.environ["PATH"], "CRTOOLS_SCRIPT_ACTION": action, "CRTOOLS_IMAGE_DIR": str(podman)}
    return subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=30)


def _restore_dirs(tmp_path: Path) -> tuple[Path, Path]:
    """The restore's image directory as podman unpacked it, and the daemon's (the agent's) copy."""
    podman, images = tmp_path / "podman", tmp_path / "images"
    for d in (podman, images):
        d.mkdir()
        (d / "pagemap-1.img").write_bytes(b"lazy pagemap")
        (d / "pages-1.img").write_bytes(b"old pages")
        (d / "mm-1.img").write_bytes(b"mm")
    return podman, images


def _arrives(images: Path, files: dict[str, bytes]) -> None:
    """A prefetch upload as the agent leaves it once committed: the source's tar, moved whole."""
    src = images.parent / "packed"
    src.mkdir(exist_ok=True)
    for name, data in files.items():
        (src / name).write_bytes(data)
    part = images.parent / "prefetch.tar.part"
    subprocess.run(["tar", "-C", str(src), "-cf", str(part), "."], check=True)
    part.rename(images / "prefetch.tar")


def test_the_pre_restore_script_swaps_in_a_prefetch_that_is_there(tmp_path: Path) -> None:
    podman, images = _restore_dirs(tmp_path)
    _arrives(images, {"pagemap-1.img": b"present pagemap", "pages-1.img": b"old pages + prefetched pages"})
    text = node_prefetch.script(images, 1.0)
    # any other step of the restore: nothing happens
    assert _run_script(text, podman, "post-restore").returncode == 0
    assert (podman / "pagemap-1.img").read_bytes() == b"lazy pagemap" and node_prefetch.outcome(images) is None
    p = _run_script(text, podman)
    assert p.returncode == 0, p.stderr
    assert (podman / "pagemap-1.img").read_bytes() == b"present pagemap"
    assert (podman / "pages-1.img").read_bytes() == b"old pages + prefetched pages"
    assert (podman / "mm-1.img").read_bytes() == b"mm"
    # the daemon reads the new pagemap; it never reads pages from a remote dump
    assert (images / "pagemap-1.img").read_bytes() == b"present pagemap"
    assert (images / "pages-1.img").read_bytes() == b"old pages"
    done = node_prefetch.outcome(images)
    assert done is not None and done["outcome"] == "used" and done["script_s"] >= 0


def test_a_prefetch_not_there_at_pre_restore_is_waited_for_at_the_last_step_before_pagemaps_are_read(
    tmp_path: Path,
) -> None:
    podman, images = _restore_dirs(tmp_path)
    text = node_prefetch.script(images, 5.0)
    p = _run_script(text, podman)  # pre-restore: not there, no wait
    assert p.returncode == 0 and node_prefetch.outcome(images) is None
    _arrives(images, {"pagemap-1.img": b"present pagemap"})  # while CRIU restores the namespaces
    p = _run_script(text, podman, "post-setup-namespaces")
    assert p.returncode == 0, p.stderr
    assert (podman / "pagemap-1.img").read_bytes() == b"present pagemap"
    done = node_prefetch.outcome(images)
    assert done is not None and done["outcome"] == "used"
    _not_swapped_again(text, podman, images)


def _not_swapped_again(text: str, podman: Path, images: Path) -> None:
    """Once swapped in, a later step leaves the images as they are."""
    (images / "prefetch.tar").unlink()
    _arrives(images, {"pagemap-1.img": b"changed"})
    assert _run_script(text, podman, "post-setup-namespaces").returncode == 0
    assert (podman / "pagemap-1.img").read_bytes() == b"present pagemap"


def test_the_old_path_waits_for_the_prefetch_at_pre_restore(tmp_path: Path) -> None:
    podman, images = _restore_dirs(tmp_path)
    p = _run_script(node_prefetch.script(images, 0.02, defer=False), podman)
    assert p.returncode == 0, p.stderr
    done = node_prefetch.outcome(images)
    assert done is not None and done["outcome"] == "missed"


def test_a_prefetch_swapped_in_at_pre_restore_is_not_swapped_again(tmp_path: Path) -> None:
    podman, images = _restore_dirs(tmp_path)
    _arrives(images, {"pagemap-1.img": b"present pagemap"})
    text = node_prefetch.script(images, 1.0)
    assert _run_script(text, podman).returncode == 0
    _not_swapped_again(text, podman, images)


def test_a_prefetch_that_is_late_leaves_the_restore_fully_lazy(tmp_path: Path) -> None:
    podman, images = _restore_dirs(tmp_path)
    text = node_prefetch.script(images, 0.02)
    assert _run_script(text, podman).returncode == 0
    p = _run_script(text, podman, "post-setup-namespaces")
    assert p.returncode == 0, p.stderr
    assert (podman / "pagemap-1.img").read_bytes() == b"lazy pagemap"
    assert (images / "pagemap-1.img").read_bytes() == b"lazy pagemap"
    done = node_prefetch.outcome(images)
    assert done is not None and done["outcome"] == "missed"


def test_a_prefetch_that_cannot_be_copied_fails_the_restore(tmp_path: Path) -> None:
    _, images = _restore_dirs(tmp_path)
    _arrives(images, {"pages-1.img": b"new"})
    p = _run_script(node_prefetch.script(images, 1.0), tmp_path / "gone")
    assert p.returncode != 0  # CRIU aborts the restore on a failed pre-restore script: it rolls back
    assert node_prefetch.outcome(images) is None


class _Stream:
    """A stream transport that keeps what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, str, str]] = []

    def with_seal(self, sealed: Seal | None) -> _Stream:
        self.sealed = sealed
        return self

    def send(self, archive: Path, to: str) -> dict[str, Any]:
        assert self.sealed is not None
        self.sent.append((archive.name, archive.read_bytes(), to, self.sealed.checkpoint))
        return {"bytes": archive.stat().st_size}


def test_the_source_reads_packs_and_sends_the_prefetch_then_cleans_up(tmp_path: Path) -> None:
    buf = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    heap = os.urandom(8 * PAGE)
    buf[:] = heap
    pid = os.getpid()
    images, present = _images(tmp_path, pid, _address(buf), 8)
    dump = {p.name: p.read_bytes() for p in images.iterdir()}
    files, stream = CheckpointDir(tmp_path / "checkpoints"), _Stream()
    files.root.mkdir()
    node = Prefetches(files, stream, lambda cid: True)  # type: ignore[arg-type]
    node.start("m1", images, pid, 1 << 20, "10.77.0.12", Seal("00" * 32, "m1"))
    node.threads["m1"].join(30)
    res = node.status("m1")
    assert res is not None and res["state"] == "sent" and res["bytes"] == 8 * PAGE, res
    [(name, data, to, sealed_for)] = stream.sent
    assert name == "m1.prefetch.tar" and to == "10.77.0.12" and sealed_for == "m1"
    # the dump's own images are untouched: the archive sent up front holds them as CRIU wrote them
    assert {p.name: p.read_bytes() for p in images.iterdir()} == dump
    # nothing of it stays on the source
    assert list(files.root.iterdir()) == [files.work("m1")] and not any(files.work("m1").iterdir())

    # the target: the upload, committed, is moved whole to where the action script looks
    target = CheckpointDir(tmp_path / "target")
    target.root.mkdir()
    target.archive("m1.prefetch").write_bytes(data)
    keys = {"m1"}  # the target's migration keys: a deleted checkpoint's key is gone
    Prefetches(target, stream, keys.__contains__).unpack("m1.prefetch")  # type: ignore[arg-type]
    assert (target.pages("m1") / "prefetch.tar").read_bytes() == data
    assert not target.archive("m1.prefetch").exists()
    got = tmp_path / "got"
    got.mkdir()
    subprocess.run(["tar", "-C", str(got), "-xf", str(target.pages("m1") / "prefetch.tar")], check=True)
    assert (got / "pages-3.img").read_bytes() == present + heap
    assert prefetch.read_pagemap(got / f"pagemap-{pid}.img")[2][-1] == Entry(_address(buf), 8, PE_PRESENT)
    # when it arrived is kept for the record, beside the script's outcome
    (target.pages("m1") / "prefetch.used").write_text("1.0 1.5")
    done = node_prefetch.outcome(target.pages("m1"))
    assert done is not None and done["outcome"] == "used" and done["arrived_at"] > 0
    # an upload that commits after its checkpoint was deleted here is thrown away, not unpacked
    keys.clear()
    target.remove("m1")
    target.archive("m1.prefetch").write_bytes(data)
    Prefetches(target, stream, keys.__contains__).unpack("m1.prefetch")  # type: ignore[arg-type]
    assert list(target.root.iterdir()) == []
    node.stop("m1")
    assert node.status("m1") is None
    buf.close()


def test_a_prefetch_that_fails_is_reported_and_leaves_nothing(tmp_path: Path) -> None:
    files, stream = CheckpointDir(tmp_path / "checkpoints"), _Stream()
    files.root.mkdir()
    node = Prefetches(files, stream, lambda cid: True)  # type: ignore[arg-type]
    images = tmp_path / "dump"
    images.mkdir()
    (images / f"pagemap-{os.getpid()}.img").write_bytes(MAGIC + b"\x03\x00\x00\x00\x0a\x01\x00")  # not CRIU's
    node.start("m2", images, os.getpid(), 1 << 20, "10.77.0.12", Seal("00" * 32, "m2"))
    node.threads["m2"].join(30)
    res = node.status("m2")
    assert res is not None and res["state"] == "failed" and "wire type 2" in res["error"]
    assert stream.sent == [] and not files.archive("m2.prefetch").exists()
    assert not any(files.work("m2").iterdir())
