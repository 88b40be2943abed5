"""Just enough of CRIU's image format to count pages (standard library only).

A CRIU image is ``IMG_COMMON_MAGIC``, the image's own magic, then protobuf entries, each preceded by
its length (u32, little endian). A pagemap image holds a ``pagemap_head`` then one ``pagemap_entry``
(vaddr = 1, nr_pages = 2, in_parent = 3, flags = 4) per run of pages; ``PE_LAZY`` marks the pages a
lazy dump left on the source, to be served by its page server (``criu/include/pagemap.h``,
``images/pagemap.proto``).
"""

from __future__ import annotations

import struct
import tarfile
from pathlib import Path

IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
PE_PARENT, PE_LAZY, PE_PRESENT = 1 << 0, 1 << 1, 1 << 2
PAGE = 4096


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(msg: bytes) -> dict[int, int]:
    """The varint fields of one protobuf message (pagemap entries have no others)."""
    out: dict[int, int] = {}
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        if key & 7 != 0:
            raise ValueError(f"unexpected protobuf wire type {key & 7} in a pagemap entry")
        out[key >> 3], i = _varint(msg, i)
    return out


def pagemap_pages(data: bytes) -> dict[str, int]:
    """Pages per kind in one pagemap image: ``lazy``, ``present`` (in pages-*.img), ``parent``."""
    magic, kind = struct.unpack_from("<II", data, 0)
    if magic != IMG_COMMON_MAGIC or kind != PAGEMAP_MAGIC:
        raise ValueError(f"not a CRIU pagemap image (magic {magic:#x} {kind:#x})")
    counts = {"lazy": 0, "present": 0, "parent": 0}
    i, first = 8, True
    while i < len(data):
        (size,) = struct.unpack_from("<I", data, i)
        entry = _fields(data[i + 4 : i + 4 + size])
        i += 4 + size
        if first:  # pagemap_head
            first = False
            continue
        flags, n = entry.get(4, PE_PRESENT), entry.get(2, 0)
        if flags & PE_LAZY:
            counts["lazy"] += n
        elif flags & PE_PARENT or entry.get(3):
            counts["parent"] += n
        else:
            counts["present"] += n
    return counts


def archive_pages(archive: Path) -> dict[str, int]:
    """Pages per kind over every pagemap image in a podman/CRI-O checkpoint archive."""
    total = {"lazy": 0, "present": 0, "parent": 0}
    with tarfile.open(archive) as tar:
        for m in tar:
            name = m.name.removeprefix("./")
            if name.startswith("checkpoint/pagemap-") and name.endswith(".img"):
                f = tar.extractfile(m)
                if f is not None:
                    for k, v in pagemap_pages(f.read()).items():
                        total[k] += v
    return total
