"""The upstream Kubernetes binaries, built here from the ``k8s.io/kubernetes`` module at the release
pinned by the repository's wrapper module (``upstream/kubernetes/go.mod`` and its ``go.sum``).

No registry this project reaches ships the binaries, but the Go module proxy serves the source. As
a dependency, k8s.io/kubernetes's own ``./staging`` replaces are ignored, so the wrapper replaces
each staging module by its published version of the same release. The binaries are static
(CGO_ENABLED=0: they run inside the node image whatever its libc), report the release as their
version (``-X k8s.io/component-base/version.gitVersion``) and are cached in
``$PODMIGRATE_HOME/kubernetes/<key>/bin``, the key hashing the wrapper module, the Go version and
the flags: a changed pin builds once more, anything else never. Go's module and build caches live
beside them (``$PODMIGRATE_HOME/go``), so a rebuild after a pin change reuses what it can. One build
at a time per home (a lock); it writes into a temporary directory renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from podmigrate import filelock
from podmigrate.errors import LabError, PreflightError
from podmigrate.lab.host import home

COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl")
MODULE = Path(__file__).resolve().parents[3] / "upstream" / "kubernetes"
Progress = Callable[[str, int, int], None]  # component, its index (1-based), how many


def pinned_version(module: Path = MODULE) -> str:
    """The k8s.io/kubernetes release the wrapper module requires (e.g. v1.37.2)."""
    text = (module / "go.mod").read_text()
    m = re.search(r"^(?:require\s+|\t)k8s\.io/kubernetes (v\d+\.\d+\.\d+)\s*$", text, re.M)
    if m is None:
        raise LabError(f"{module / 'go.mod'} does not require k8s.io/kubernetes at a release")
    return m.group(1)


def go_version() -> str:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    try:
        out = subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise PreflightError(
            "Go is needed to build upstream Kubernetes and was not found",
            hint="install Go 1.26 (the project's machines have it in /usr/local/go/bin)",
        ) from e
    return out.split()[2]


def ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    flags = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",  # reproducible: the pin says what it is
    }
    sets = [f"-X {pkg}.{k}={v}" for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
            for k, v in flags.items()]  # fmt: skip
    return " ".join(["-s", "-w", *sets])


def key(module: Path = MODULE) -> str:
    h = hashlib.sha256()
    for f in ("go.mod", "go.sum"):
        h.update((module / f).read_bytes())
    h.update(f"{go_version()} {ldflags(pinned_version(module))} CGO_ENABLED=0 -trimpath".encode())
    return h.hexdigest()[:16]


def go_env(base: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(base / "go" / "mod"),
        GOCACHE=str(base / "go" / "cache"),
        GOFLAGS="-modcacherw -mod=readonly -trimpath",
        CGO_ENABLED="0",
        GOTOOLCHAIN="local",
    )
    env["PATH"] = f"{Path(shutil.which('go') or '/usr/local/go/bin/go').parent}:{env.get('PATH', '')}"
    return env


def bin_dir(base: Path | None = None, module: Path = MODULE) -> Path:
    return (base or home()) / "kubernetes" / key(module) / "bin"


def ready(base: Path | None = None, module: Path = MODULE) -> bool:
    d = bin_dir(base, module)
    return all((d / c).is_file() for c in COMPONENTS)


def ensure(progress: Progress = lambda _c, _i, _n: None, base: Path | None = None, module: Path = MODULE) -> Path:
    """The directory holding the binaries of the pinned release, built if they are not yet."""
    base = base or home()
    dest = bin_dir(base, module)
    if ready(base, module):
        return dest
    with filelock.held(base / "kubernetes" / ".lock"):
        if ready(base, module):  # another build finished while this one waited
            return dest
        version, env = pinned_version(module), go_env(base)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent.parent))
        try:
            logs = work / "logs"
            logs.mkdir()
            (work / "bin").mkdir()
            for i, component in enumerate(COMPONENTS, 1):
                progress(component, i, len(COMPONENTS))
                _build(component, version, env, module, work, logs)
            (work / "built.json").write_text(f'{{"version": "{version}", "at": {time.time()}}}\n')
            dest.parent.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dest.parent, ignore_errors=True)  # a half one of an older layout
            work.chmod(0o755)
            (work / "bin").chmod(0o755)
            work.rename(dest.parent)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest


def _build(component: str, version: str, env: dict[str, str], module: Path, work: Path, logs: Path) -> None:
    out = work / "bin" / component
    log = logs / f"{component}.log"
    argv = ["go", "build", "-p", str(os.cpu_count() or 2), "-ldflags", ldflags(version), "-o", str(out),
            f"k8s.io/kubernetes/cmd/{component}"]  # fmt: skip
    with open(log, "w") as f:
        p = subprocess.run(argv, cwd=module, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise LabError(
            f"building {component} {version} failed (go build exit {p.returncode})",
            hint="the log tail is below; a network problem reaching the Go module proxy is the usual cause",
            details={"log_tail": tail},
        )
