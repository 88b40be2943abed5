"""A lazy dump's small mappings travel with it: the pages a copy touches first, made eager.

A post-copy restore runs before its memory is there, and every page it touches is then fetched over
the LAN one at a time (CRIU's lazy-pages daemon asks for the faulting page alone). Measured on the
workload: the pages a request touches lie outside the big heap mapping (interpreter state, malloc
arenas, stacks), some 500 faults in a row, 0.08-0.17 s of the blackout. The source's tasks stay
frozen while CRIU serves their pages (it thaws or kills them only after the last page), so once the
dump serves, the source agent reads the lazy pages of the smallest mappings, up to a budget, from
``/proc/PID/mem`` and rewrites the dump's images so that those pages are present rather than lazy:
the restore installs them eagerly and the daemon never asks for them. The big mappings stay lazy.

The images are CRIU's (``images/pagemap.proto``): ``pagemap-PID.img`` is two magic words, then
length-prefixed protobuf messages (a head naming ``pages-ID.img``, then one entry per run of pages,
in address order); ``pages-ID.img`` holds the present entries' pages back to back. A small protobuf
codec is written out here (five integer fields), since the node agent runs on the node's Python.
Standard library only.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = 4096
# the budget: the workload's ~16 MB of interpreter state and arenas fit, a heap of 64 MB or more stays lazy
DEFAULT_MB = 32
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4  # criu/include/pagemap.h


@dataclass(frozen=True)
class Entry:
    vaddr: int
    nr_pages: int
    flags: int

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE

    @property
    def lazy_only(self) -> bool:
        """Pages the source serves on demand (a lazy dump leaves them out of pages-ID.img)."""
        return bool(self.flags & PE_LAZY) and not self.flags & PE_PRESENT


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7


def _put(value: int) -> bytes:
    out = bytearray()
    while True:
        b, value = value & 0x7F, value >> 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(msg: bytes) -> dict[int, int]:
    fields, i = {}, 0
    while i < len(msg):
        key, i = _varint(msg, i)
        if key & 7 != 0:
            raise ValueError(f"unexpected protobuf wire type {key & 7} in a pagemap image")
        fields[key >> 3], i = _varint(msg, i)
    return fields


def read_pagemap(path: Path) -> tuple[bytes, int, list[Entry]]:
    """The magic words, the pages image's id and the entries of CRIU image ``path``."""
    data = path.read_bytes()
    magic, i, msgs = data[:8], 8, []
    while i < len(data):
        (size,) = struct.unpack_from("<I", data, i)
        msgs.append(data[i + 4 : i + 4 + size])
        i += 4 + size
    if not msgs:
        raise ValueError(f"{path.name} has no head")
    pages_id = _fields(msgs[0]).get(1, 0)
    entries = []
    for m in msgs[1:]:
        f = _fields(m)
        # images of old CRIUs carry the count in compat_nr_pages (field 2) and no flags
        entries.append(Entry(f[1], f.get(5, f.get(2, 0)), f.get(4, PE_PRESENT)))
    return magic, pages_id, entries


def encode_pagemap(magic: bytes, pages_id: int, entries: list[Entry]) -> bytes:
    def message(body: bytes) -> bytes:
        return struct.pack("<I", len(body)) + body

    out = [magic, message(b"\x08" + _put(pages_id))]
    for e in entries:
        # vaddr (1), compat_nr_pages (2, required, 0 as CRIU writes it), flags (4), nr_pages (5)
        out.append(message(b"\x08" + _put(e.vaddr) + b"\x10\x00\x20" + _put(e.flags) + b"\x28" + _put(e.nr_pages)))
    return b"".join(out)


def mappings(pid: int) -> list[tuple[int, int]]:
    """The address ranges of process ``pid``'s mappings."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        lo, hi = line.split(None, 1)[0].split("-")
        out.append((int(lo, 16), int(hi, 16)))
    return out


def choose(entries: list[Entry], maps: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """The mappings whose lazy pages go eagerly: smallest (in lazy pages) first, while their pages
    fit in ``budget`` bytes. A mapping too big for what is left is skipped, a smaller one after it
    may still fit: the big heap stays lazy, the many small mappings around it do not."""
    lazy: dict[tuple[int, int], int] = {}
    for e in (e for e in entries if e.lazy_only):
        for lo, hi in maps:
            overlap = min(hi, e.end) - max(lo, e.vaddr)
            if overlap > 0:
                lazy[(lo, hi)] = lazy.get((lo, hi), 0) + overlap
    chosen, left = [], budget
    for vma, size in sorted(lazy.items(), key=lambda kv: (kv[1], kv[0])):
        if size <= left:
            chosen.append(vma)
            left -= size
    return sorted(chosen)


def split(e: Entry, ranges: list[tuple[int, int]]) -> list[tuple[Entry, bool]]:
    """Entry ``e`` cut at the edges of ``ranges`` (sorted, disjoint): each piece, and whether it lies in one."""
    pieces, at = [], e.vaddr
    for lo, hi in ranges:
        lo, hi = max(lo, at), min(hi, e.end)
        if lo >= hi:
            continue
        if lo > at:
            pieces.append((Entry(at, (lo - at) // PAGE, e.flags), False))
        pieces.append((Entry(lo, (hi - lo) // PAGE, e.flags), True))
        at = hi
    if at < e.end:
        pieces.append((Entry(at, (e.end - at) // PAGE, e.flags), False))
    return pieces


def make_present(images: Path, out_dir: Path, vpid: int, pid: int, budget: int) -> dict[str, int]:
    """Task ``vpid``'s images in ``images`` rewritten into ``out_dir`` (which may be ``images``) so
    that the lazy pages of its smallest mappings are present, read from the memory of the frozen
    process ``pid``. Both files appear only once the new ones are whole, nothing if no mapping
    fits; returns what moved."""
    pagemap = images / f"pagemap-{vpid}.img"
    magic, pages_id, entries = read_pagemap(pagemap)
    ranges = choose(entries, mappings(pid), budget)
    if not ranges:
        return {"pages": 0, "mappings": 0}
    pages = images / f"pages-{pages_id}.img"
    out: list[Entry] = []
    moved = 0
    new_pages = out_dir / f"{pages.name}.prefetch"
    new_map = out_dir / f"{pagemap.name}.prefetch"
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        with open(pages, "rb") as old, open(new_pages, "wb") as new:
            os.fchmod(new.fileno(), 0o600)
            for e in entries:
                if e.flags & PE_PRESENT:
                    new.write(_exact(old.read(e.nr_pages * PAGE), e))
                    out.append(e)
                    continue
                if not e.lazy_only:
                    out.append(e)
                    continue
                for piece, hot in split(e, ranges):
                    if not hot:
                        out.append(piece)
                        continue
                    new.write(_exact(os.pread(mem, piece.nr_pages * PAGE, piece.vaddr), piece))
                    out.append(Entry(piece.vaddr, piece.nr_pages, PE_PRESENT))
                    moved += piece.nr_pages
        new_map.write_bytes(encode_pagemap(magic, pages_id, _merge(out)))
        os.chmod(new_map, 0o600)
        os.replace(new_pages, out_dir / pages.name)
        os.replace(new_map, out_dir / pagemap.name)
    finally:
        os.close(mem)
        new_pages.unlink(missing_ok=True)
        new_map.unlink(missing_ok=True)
    return {"pages": moved, "mappings": len(ranges)}


def _exact(data: bytes, e: Entry) -> bytes:
    if len(data) != e.nr_pages * PAGE:
        raise ValueError(f"short read of {e.nr_pages} pages at {e.vaddr:#x}: {len(data)} bytes")
    return data


def _merge(entries: list[Entry]) -> list[Entry]:
    """Adjacent entries with the same flags joined again (as CRIU writes them)."""
    out: list[Entry] = []
    for e in entries:
        if out and out[-1].flags == e.flags and out[-1].end == e.vaddr:
            out[-1] = Entry(out[-1].vaddr, out[-1].nr_pages + e.nr_pages, e.flags)
        else:
            out.append(e)
    return out


def task_pids(init_pid: int) -> dict[int, int]:
    """The processes in the PID namespace of ``init_pid``: their PID inside it (CRIU's image
    names) to their PID here."""
    ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                continue
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    found[int(line.split()[-1])] = int(entry)
        except (OSError, ValueError):
            continue
    return found


def pull_hot_pages(images: Path, init_pid: int, budget: int, out: Path | None = None) -> dict[str, Any]:
    """Make the smallest mappings' lazy pages present in every dumped task's images, ``budget``
    bytes in all, written into ``out`` (default: over the images themselves); a task whose images
    or process cannot be read is left fully lazy."""
    t0 = time.time()
    moved = mapped = 0
    tasks = task_pids(init_pid)
    for pagemap in sorted(images.glob("pagemap-*.img")):
        vpid = pagemap.name[len("pagemap-") : -len(".img")]
        if not vpid.isdigit() or int(vpid) not in tasks:
            continue  # shmem pagemaps, or a task that is gone
        got = make_present(images, out or images, int(vpid), tasks[int(vpid)], budget - moved * PAGE)
        moved += got["pages"]
        mapped += got["mappings"]
    return {"bytes": moved * PAGE, "mappings": mapped, "seconds": round(time.time() - t0, 4)}
