"""The node agent's side of a lazy dump's prefetch (``runtime.prefetch``): sent beside the restore.

Source: once the lazy dump serves its pages (its tasks frozen until the last one has moved), a
thread reads the smallest mappings' pages into rewritten copies of the dump's ``pagemap-N.img`` and
``pages-N.img``, packs them as ``<id>.prefetch.tar`` and sends them sealed to the target, while the
controller already sends the archive and the target's podman starts its restore: none of it is
waited for inside the blackout. Only sealed migrations prefetch: the target forgets a checkpoint's
key when it is deleted, so an upload that arrives after a rollback is refused, and one already
arriving is thrown away when it commits: nothing is left behind.

Target: the committed upload is moved whole to ``<id>.pages/prefetch.tar``; CRIU's action script
(``script``), run before any task's memory is read, extracts the rewritten images into the
restore's image directory if they are there by then, and else lets the restore go on fully lazy.
Standard library only.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podmigrate.agent.checkpoints import CheckpointDir
from podmigrate.runtime import prefetch
from podmigrate.transport.stream import Seal, StreamTransport

SUFFIX = ".prefetch"  # the upload's id is <checkpoint id>.prefetch


class Prefetches:
    """``expected(cid)``: whether checkpoint ``cid`` is still wanted here (its key not yet dropped
    by a delete); an upload that commits after the delete is thrown away, not left behind."""

    def __init__(self, files: CheckpointDir, stream: StreamTransport, expected: Callable[[str], bool]):
        self.files, self.stream, self.expected = files, stream, expected
        self.threads: dict[str, threading.Thread] = {}
        self.results: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ source
    def start(self, cid: str, images: Path, pid: int, budget: int, to: str, sealed: Seal) -> None:
        self.results[cid] = {"state": "reading"}
        t = threading.Thread(
            target=self._run, args=(cid, images, pid, budget, to, sealed), name=f"prefetch-{cid}", daemon=True
        )
        self.threads[cid] = t
        t.start()

    def _run(self, cid: str, images: Path, pid: int, budget: int, to: str, sealed: Seal) -> None:
        res = self.results[cid]
        out = self.files.work(cid) / "prefetch"
        tar = self.files.archive(cid + SUFFIX)
        try:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(mode=0o700, parents=True)
            res.update(prefetch.pull_hot_pages(images, int(pid), budget, out=out))
            res["read_at"] = time.time()
            if not res["bytes"]:
                res["state"] = "nothing to send"
                return
            p = subprocess.run(["tar", "-C", str(out), "-cf", str(tar), "."], capture_output=True, text=True)
            if p.returncode:
                raise OSError(f"packing the prefetch failed: {p.stderr.strip()}")
            tar.chmod(0o600)
            res["packed_at"] = time.time()
            shutil.rmtree(out, ignore_errors=True)
            with self.files.busy(cid + SUFFIX):
                sent = self.stream.with_seal(sealed).send(tar, to)
            res.update(state="sent", sent_bytes=sent["bytes"], sent_at=time.time())
        except Exception as e:  # the restore goes on fully lazy; the reason is kept for the record
            res.update(state="failed", error=f"{type(e).__name__}: {e}")
        finally:
            shutil.rmtree(out, ignore_errors=True)
            tar.unlink(missing_ok=True)

    def status(self, cid: str) -> dict[str, Any] | None:
        return self.results.get(cid)

    def stop(self, cid: str) -> None:
        """Before checkpoint ``cid``'s files go: let its reader and sender finish (they end on
        their own: a read of the frozen tasks, one upload with its timeout)."""
        t = self.threads.pop(cid, None)
        if t is not None:
            t.join(timeout=150)
        self.results.pop(cid, None)

    # ------------------------------------------------------------------ target
    def unpack(self, upload: str) -> None:
        """A committed ``<id>.prefetch`` upload: moved whole to ``<id>.pages/prefetch.tar`` (one
        rename), where the restore's action script extracts it straight into CRIU's image directory;
        unpacking it here first would be one more 16 MB copy on the restore's critical path."""
        cid = upload.removesuffix(SUFFIX)
        tar = self.files.archive(upload)
        try:
            if not self.expected(cid):
                return
            pages = self.files.pages(cid)
            pages.mkdir(mode=0o700, exist_ok=True)
            arrived = time.time()
            tar.rename(pages / "prefetch.tar")
            (pages / "prefetch.arrived").write_text(str(arrived))
            if not self.expected(cid):  # deleted meanwhile: what it made goes too
                shutil.rmtree(pages, ignore_errors=True)
        finally:
            tar.unlink(missing_ok=True)


def script(images: Path, wait_s: float, defer: bool = True) -> str:
    """CRIU's action script for a restore that expects a prefetch in ``images/prefetch.tar``.

    CRIU runs it at every step. The rewritten images must be in place before a restored task reads
    its pagemap (criu/mem.c ``prepare_mappings``, in the root task once CRIU has passed
    post-setup-namespaces; the lazy-pages daemon reads its copies even later, once the tasks
    register). So at pre-restore (no task yet) a prefetch already there is swapped in at once; if
    it is not there yet, the script waits for it at post-setup-namespaces, up to ``wait_s``, while
    CRIU has restored the namespaces in the meantime. The swap extracts the images over the ones
    podman unpacked (``CRTOOLS_IMAGE_DIR``: CRIU's open image directory) and the pagemaps over the
    lazy-pages daemon's. A failed extraction fails the restore, which rolls back: a half-written
    pages image must never be restored. A restore without namespaces never reaches the second step:
    a prefetch not there at pre-restore is then left out (no outcome recorded). ``defer=False``
    waits at pre-restore instead (engine.paths "prefetch-wait-at-pre-restore", the old path)."""
    tries = max(1, int(wait_s / 0.002))
    return f"""#!/bin/sh
d='{images}'
case "$CRTOOLS_SCRIPT_ACTION" in
  pre-restore) [ -e "$d/prefetch.tar" ] || [ {int(defer)} = 0 ] || {{ : > "$d/prefetch.asked"; exit 0; }} ;;
  post-setup-namespaces) [ -e "$d/prefetch.asked" ] && [ ! -e "$d/prefetch.used" ] || exit 0 ;;
  *) exit 0 ;;
esac
t0=$(date +%s.%N)
n=0
while [ ! -e "$d/prefetch.tar" ]; do
  if [ $n -ge {tries} ]; then echo "$t0 $(date +%s.%N)" > "$d/prefetch.missed"; exit 0; fi
  sleep 0.002; n=$((n+1))
done
tar -x -C "$CRTOOLS_IMAGE_DIR" -f "$d/prefetch.tar" || exit 1
tar -x -C "$d" -f "$d/prefetch.tar" --wildcards '*pagemap-*.img' || exit 1
echo "$t0 $(date +%s.%N)" > "$d/prefetch.used"
"""


def outcome(images: Path) -> dict[str, Any] | None:
    """What the action script did: ``used`` or ``missed`` (too late), when it started and how long
    it took, and when the prefetch arrived (this node's clock); None if the script did not run."""
    arrived: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        arrived = {"arrived_at": float((images / "prefetch.arrived").read_text())}
    for state in ("used", "missed"):
        with contextlib.suppress(OSError, ValueError):
            started, ended = (float(x) for x in (images / f"prefetch.{state}").read_text().split())
            return {"outcome": state, "script_started": started, "script_s": round(ended - started, 4), **arrived}
    return None
