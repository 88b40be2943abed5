"""podmigrate's CRIU (lab.criu_build): the source it is built from is checked, the lab's nodes run it
for every CRIU run while the packaged binary stays as Debian shipped it, and both ways of a lazy
dump (its pages left in the frozen tasks, or pinned in pipes as CRIU does on its own) move the heap."""

from __future__ import annotations

import functools
import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podmigrate.engine.controller import Plan, migrate
from podmigrate.errors import LabError
from podmigrate.lab import criu_build


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """A Debian-pool-shaped HTTP server on loopback: its URL, its pool directory, the paths asked for."""
    pool = tmp_path / "mirror/pool/main/c/criu"
    pool.mkdir(parents=True)
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path / "mirror"))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", pool, asked
    finally:
        server.shutdown()
        server.server_close()


def test_the_source_is_taken_only_with_the_checksum_the_patch_was_made_for(
    mirror: tuple[str, Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, pool, asked = mirror
    (pool / criu_build.ORIG).write_bytes(b"not the criu 4.2.1 release")
    cache = tmp_path / "cache"
    with pytest.raises(LabError, match=f"has SHA-256 .* not the {criu_build.ORIG_SHA256}"):
        criu_build.fetch(cache, url)
    assert list(cache.iterdir()) == [], "nothing of a refused download is kept"
    # the same bytes, had they been the release: taken, and kept for the next image
    monkeypatch.setattr(criu_build, "ORIG_SHA256", hashlib.sha256(b"not the criu 4.2.1 release").hexdigest())
    got = criu_build.fetch(cache, url)
    assert got == cache / criu_build.ORIG and got.read_bytes() == b"not the criu 4.2.1 release"
    assert criu_build.fetch(cache, url) == got
    assert len(asked) == 2, asked  # the refused download and the first good one; the third came from the cache
    with pytest.raises(LabError, match="is the Debian mirror reachable"):
        criu_build.fetch(tmp_path / "elsewhere", url + "/nothing-here")


def test_the_image_key_follows_the_patch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = criu_build.spec()
    changed = tmp_path / "0001-lazy-dump-mode-read.patch"
    changed.write_bytes(criu_build.PATCHES[0].read_bytes() + b"\n")
    monkeypatch.setattr(criu_build, "PATCHES", [changed])
    assert criu_build.spec() != before, "a changed patch must rebuild the node image's CRIU"


@pytest.mark.lab
def test_every_criu_run_on_a_node_is_podmigrates_build_and_the_package_is_untouched(lab: Any) -> None:
    for node in ("node-a", "node-b"):
        # what runc, podman and the agents find first in the PATH: the gate, which runs the build
        assert "--lazy-dump-mode" in lab.run(node, ["criu", "--help"]).stdout
        assert "--lazy-dump-mode" not in lab.run(node, ["/usr/sbin/criu", "--help"]).stdout
        assert lab.run(node, ["dpkg", "--verify", "criu"], check=False).returncode == 0
        info = lab.agent(node).get("/v1/info")
        assert info["capabilities"]["lazy_dump_read"] is True, info


@pytest.mark.lab
@pytest.mark.parametrize("old_path", [False, True])
def test_a_lazy_dump_moves_the_heap_with_its_pages_left_in_the_frozen_tasks_or_spliced(
    lab: Any, workload: Any, old_path: bool
) -> None:
    """The new path, and what ``bench engine --old-paths lazy-dump-splice`` measures it against."""
    st = workload(node="node-a", heap_mb=48)
    old = ("lazy-dump-splice",) if old_path else ()
    rec = migrate(lab, Plan(workload=st["name"], target="node-b", mode="lazy", old_paths=old))
    assert rec["status"] == "completed" and rec["state_after"]["sha256"] == st["sha256"], rec.get("error")
    assert rec["lazy"]["dump_mode"] == ("splice" if old_path else "read")
    assert rec.get("old_paths", []) == list(old)
    # every page of the heap crossed after the freeze, on demand or in the background, and the
    # source's CRIU exited 0 only after the target's daemon had them all
    assert rec["bytes"]["pages"] >= 48 << 20
    assert rec["lazy"]["source_rc"] == 0 and rec["lazy"]["daemon_rc"] == 0
