"""The upstream Kubernetes build (``kube.build``) without building: the wrapper module's pin and its
replaces, the version stamped into the binaries, the cache key, and the build's all-or-nothing
install, driven by a fake ``go`` (a shell script that writes a file per binary) on the PATH."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest

from podmigrate.errors import LabError
from podmigrate.kube import build

FAKE_GO = """#!/bin/sh
# a fake go: `go version` answers, `go build ... -o OUT PKG` writes OUT (fails for PKG named in $FAIL)
if [ "$1" = version ]; then echo "go version go1.26.8 linux/amd64"; exit 0; fi
out=""; prev=""; last=""
for a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; last=$a; done
case " $FAIL " in *" ${last##*/} "*) echo "cannot build $last" >&2; exit 1;; esac
echo "$last $GOCACHE" > "$out"
echo built >> "$(dirname "$0")/calls"
"""


def test_the_wrapper_pins_one_release_and_replaces_each_staging_module_by_it() -> None:
    version = build.pinned_version()
    assert re.fullmatch(r"v1\.\d+\.\d+", version)
    staging = f"v0.{version.split('.', 1)[1]}"
    text = (build.MODULE / "go.mod").read_text()
    replaces = re.findall(r"^\t(k8s\.io/\S+) => (\S+) (\S+)$", text, re.M)
    assert len(replaces) >= 30
    assert all(a == b and v == staging for a, b, v in replaces), replaces
    assert "k8s.io/kubernetes " + version in (build.MODULE / "go.sum").read_text()


def test_the_binaries_say_the_pinned_release() -> None:
    flags = build.ldflags("v1.37.2")
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {pkg}.gitVersion=v1.37.2" in flags
        assert f"-X {pkg}.gitMinor=37" in flags and f"-X {pkg}.gitTreeState=clean" in flags


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "go").write_text(FAKE_GO)
    (tools / "go").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    module = tmp_path / "module"
    shutil.copytree(build.MODULE, module)
    return tools, module


def test_a_build_installs_all_of_them_at_once_and_a_second_call_builds_nothing(
    tmp_path: Path, fake: tuple[Path, Path]
) -> None:
    tools, module = fake
    base = tmp_path / "home"
    seen: list[str] = []
    threads = [
        threading.Thread(target=build.ensure, kwargs={"progress": lambda c, i, n: seen.append(c), "base": base,
                                                      "module": module})
        for _ in range(2)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = build.bin_dir(base, module)
    assert sorted(p.name for p in d.iterdir()) == sorted(build.COMPONENTS)
    assert (d / "kubelet").read_text().split()[0] == "k8s.io/kubernetes/cmd/kubelet"
    assert (d / "kubelet").read_text().split()[1] == str(base / "go" / "cache")  # Go's caches kept in the home
    assert (tools / "calls").read_text().count("built") == len(build.COMPONENTS) and seen == list(build.COMPONENTS)
    build.ensure(base=base, module=module)
    assert (tools / "calls").read_text().count("built") == len(build.COMPONENTS)
    # a new pin is a new key: built again, beside the old one
    mod = module / "go.mod"
    mod.write_text(mod.read_text() + "\n// changed\n")
    assert build.bin_dir(base, module) != d and not build.ready(base, module)


def test_a_failed_build_says_which_and_leaves_nothing_half_made(
    tmp_path: Path, fake: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _tools, module = fake
    base = tmp_path / "home"
    monkeypatch.setenv("FAIL", "kube-scheduler")
    with pytest.raises(LabError, match="building kube-scheduler v1\\.") as e:
        build.ensure(base=base, module=module)
    assert "cannot build k8s.io/kubernetes/cmd/kube-scheduler" in "\n".join(e.value.details["log_tail"])
    assert [p.name for p in (base / "kubernetes").iterdir()] == [".lock"]
