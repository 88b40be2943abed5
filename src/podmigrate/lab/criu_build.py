"""podmigrate's CRIU: the node image's CRIU rebuilt from Debian's source with the patches in
``criu_patches``, installed beside the packaged one and run for every CRIU run on a node.

``0001-lazy-dump-mode-read``: ``--lazy-dump-mode=read`` leaves a lazy dump's pages in the frozen tasks
(read with ``process_vm_readv`` when the target asks) instead of pinning them into pipes inside the
freeze, the one step of a lazy dump that grew with the heap (issue 14; engine.paths
"lazy-dump-splice" measures it).

``0002-rlimits-without-cap-sys-resource``: a root without CAP_SYS_RESOURCE (this lab's, a hardened
host's) may not prlimit() another user's task, so packaged CRIU cannot dump a non-root process at
all ("Can't get rlimit 0"); this one reads such a task's limits from /proc/PID/limits, and on restore
keeps a hard limit it may not raise at the restorer's own (clamped, not left unset), both logged
(issue 31, tests/test_nonroot.py).

``0003-lazy-pages-pipelined-background``: the lazy-pages daemon keeps two background requests in
flight instead of one, waits in epoll instead of spinning while they are, and doubles its chunk per
request: a 1 GB post-copy tail went from 130-150 to 413-457 MB/s (issue 35; the patch's message has
the measurements).

It is built once per image, in a throw-away overlay of the image (the compiler and the -dev packages
never enter it), against the image's own libraries, from the same upstream tarball as Debian's
package, checked by its SHA-256. CRIU keys its kernel-feature cache (/run/criu.kdat) to its build
time (``KDAT_MAGIC_2``): two CRIU binaries on one node would throw each other's cache away, and every
run would probe the kernel again (some 30 ms), so the gate (``runtime.speculative``) hands every run
to this one, and the build time is fixed.

Two builds may share ``cache`` (two homes' images never do, but two checkouts' may): each works in
its own temporary directory, the tarball is downloaded under a unique name and renamed into place,
and what crashed builds left is removed only under ``cache/.lock``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from podmigrate import filelock
from podmigrate.errors import LabError

VERSION = "4.2.1"
ORIG = f"criu_{VERSION}.orig.tar.xz"
ORIG_SHA256 = "29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9"
PATCHES = sorted(Path(__file__).with_name("criu_patches").glob("*.patch"))
BINARY = "/usr/local/lib/podmigrate/criu"
# the image's CRIU links these libraries from trixie but libnl and libnet, which criu/sid pulled from sid
BUILD_DEPS = (
    "gcc make pkgconf patch xz-utils protobuf-compiler protobuf-c-compiler libprotobuf-dev libprotobuf-c-dev "
    "libbsd-dev libcap-dev libgnutls28-dev libnftables-dev uuid-dev libnl-3-dev/sid libnet1-dev/sid"
)
SOURCE_DATE_EPOCH = 1796515200  # 2026-12-05: the build time CRIU's kdat cache is keyed to

Run = Callable[[list[str], str], None]  # argv, the step's name (NodeImage._run)


def spec() -> str:
    """What the build depends on, for the image's cache key."""
    h = hashlib.sha256(f"{VERSION} {ORIG_SHA256} {BUILD_DEPS} {SOURCE_DATE_EPOCH}".encode())
    for p in PATCHES:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def fetch(cache: Path, mirror: str) -> Path:
    """The upstream tarball from Debian's pool, into ``cache`` (kept: the pool drops old versions)."""
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / ORIG
    if dest.exists() and _sha256(dest) == ORIG_SHA256:
        return dest
    url = f"{mirror}/pool/main/c/criu/{ORIG}"
    part = dest.with_name(f"{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
    try:
        with urllib.request.urlopen(url, timeout=120) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise LabError(
            f"downloading {url} failed: {e}",
            hint="is the Debian mirror reachable? (it is the host's apt mirror, or PODMIGRATE_MIRROR)",
        ) from e
    got = _sha256(part)
    if got != ORIG_SHA256:
        part.unlink()
        raise LabError(
            f"{url} has SHA-256 {got}, not the {ORIG_SHA256} the patches were made for",
            hint="set PODMIGRATE_MIRROR to a mirror that serves Debian's criu source unchanged",
        )
    part.rename(dest)
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def script(root: Path, work: Path) -> str:
    """The build, run in a private mount namespace: ``work/upper`` over the image, chrooted."""
    merged = work / "merged"
    return f"""set -e
mount -t overlay overlay -o lowerdir={root},upperdir={work}/upper,workdir={work}/work {merged}
mount --bind /dev {merged}/dev
mount -t proc proc {merged}/proc
chroot {merged} /bin/sh -ec '
export DEBIAN_FRONTEND=noninteractive LC_ALL=C SOURCE_DATE_EPOCH={SOURCE_DATE_EPOCH}
apt-get -o Acquire::Check-Valid-Until=false update -q
apt-get install -y -q --no-install-recommends {BUILD_DEPS}
cd /build
tar -xf {ORIG}
cd criu-{VERSION}
for p in ../patches/*.patch; do patch -p1 --forward <"$p"; done
make -j"$(nproc)" criu
./criu/criu --help | grep -q -- --lazy-dump-mode
grep -q "rlimits read from /proc/" criu/criu
'
"""


def build(root: Path, cache: Path, mirror: str, run: Run) -> None:
    """Build podmigrate's CRIU for the image at ``root`` and install it there as ``BINARY``."""
    orig = fetch(cache, mirror)
    with filelock.held(cache / ".lock", mode=0o644):
        for left in cache.glob("criu-build-*"):  # a crashed build's: none runs while we hold the lock
            shutil.rmtree(left, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix="criu-build-", dir=cache))
        try:
            src = work / "upper/build"
            for d in (work / "work", work / "merged", src / "patches"):
                d.mkdir(parents=True)
            shutil.copy(orig, src / ORIG)
            for p in PATCHES:
                shutil.copy(p, src / "patches" / p.name)
            run(["unshare", "-m", "--propagation", "private", "sh", "-c", script(root, work)], "criu-build")
            dest = root / BINARY.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".new")
            shutil.copy(src / f"criu-{VERSION}/criu/criu", tmp)
            tmp.chmod(0o755)
            tmp.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def installed(root: Path) -> bool:
    return (root / BINARY.lstrip("/")).is_file()
