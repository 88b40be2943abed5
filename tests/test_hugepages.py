"""The restored copy's huge pages (runtime.hugepages): which mappings would have them, and a real
process's small pages collapsed back, its memory unchanged."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from podmigrate.runtime import hugepages

SMAPS = """\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac hg
7f0000a00000-7f0001000000 rw-p 00000000 00:00 0
AnonHugePages:      6144 kB
VmFlags: rd wr mr mw me ac hg
7f0001000000-7f0001800000 rw-p 00000000 00:00 0
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac nh
7f0001800000-7f0002000000 rw-p 00000000 00:00 0
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac
7f0002000000-7f0002800000 r--p 00000000 fd:01 1234                       /usr/lib/libx.so
AnonHugePages:         0 kB
VmFlags: rd mr mw me hg
7f0002800000-7f0002801000 rw-p 00000000 00:00 0
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac hg
7f0003000100-7f0003500000 rw-p 00000000 00:00 0
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac hg
"""


def test_the_mappings_that_would_have_huge_pages_and_do_not() -> None:
    madvise = hugepages.wanted(SMAPS, "madvise")
    # madvised and empty: the whole of it; madvised and all huge already, not madvised, a file,
    # one page long: none; an unaligned one: only the 2 MB pages inside it
    assert madvise == [(0x7F0000000000, 0x7F0000A00000), (0x7F0003200000, 0x7F0003400000)]
    # under "always" every private anonymous mapping but the nh one
    always = hugepages.wanted(SMAPS, "always")
    assert always == [madvise[0], (0x7F0001800000, 0x7F0002000000), madvise[1]]
    assert hugepages.wanted(SMAPS, "never") == []


def test_the_thp_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    assert hugepages.thp_mode(tmp_path / "missing") == "never"


CHILD = textwrap.dedent(
    """
    import ctypes, hashlib, mmap, sys
    size = 16 << 20
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)  # filled 4 KB at a time, as userfaultfd fills a lazy restore
    for i in range(0, size, 4096):
        m[i:i + 8] = i.to_bytes(8, "little")
    m.madvise(mmap.MADV_HUGEPAGE)  # and flagged as the workload had it
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    print(hex(addr), hashlib.sha256(m).hexdigest(), flush=True)
    sys.stdin.readline()
    print(hashlib.sha256(m).hexdigest(), flush=True)
    """
)


def _huge_kb(pid: int, addr: int) -> int:
    text = Path(f"/proc/{pid}/smaps").read_text()
    m = re.search(rf"^{addr:x}-[0-9a-f]+ .*?\nAnonHugePages:\s+(\d+) kB", text, re.M | re.S)
    assert m, f"no mapping at {addr:x}"
    return int(m.group(1))


def _small_pages_child() -> tuple[subprocess.Popen[str], int, str]:
    """A child with 16 MB of small pages in a madvised mapping; khugepaged may merge them first (it
    scans madvised mappings on its own), and then another is made."""
    for _ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        addr_hex, sha = child.stdout.readline().split()
        if _huge_kb(child.pid, int(addr_hex, 16)) == 0:
            return child, int(addr_hex, 16), sha
        child.kill()
        child.wait()
    raise AssertionError("khugepaged merged the child's pages before the test could, five times")


def test_a_processs_small_pages_are_collapsed_back_and_its_memory_is_unchanged() -> None:
    if hugepages.thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this kernel")
    child, addr, before = _small_pages_child()
    try:
        assert child.stdout is not None and child.stdin is not None
        res = hugepages.collapse([child.pid])
        assert res["mode"] in ("madvise", "always") and res["ranges"] >= 1, res
        assert res["collapsed_bytes"] >= 12 << 20 and not res["failed"], res
        assert _huge_kb(child.pid, addr) >= 12 << 10
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == before
    finally:
        child.kill()
        child.wait()
    # a process gone meanwhile is skipped, not an error
    assert hugepages.collapse([child.pid])["ranges"] == 0
