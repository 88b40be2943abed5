"""``podmigrate kube ...``: upstream Kubernetes in the lab (``podmigrate.kube``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from podmigrate.cli.output import emit, err, out, status

if TYPE_CHECKING:
    from podmigrate.kube.cluster import KubeCluster


@click.group("kube")
def kube() -> None:
    """Upstream Kubernetes, built from the pinned k8s.io/kubernetes release, in the lab."""


@kube.command("build")
def kube_build() -> None:
    """Build (once per pin) kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
    kube-proxy and kubectl from the release upstream/kubernetes/go.mod pins; print where they are."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from podmigrate.kube import build

    version = build.pinned_version()
    if build.ready():
        out.print(f"Kubernetes {version}: already built in {build.bin_dir()}")
        return
    t0 = time.monotonic()
    if not err.is_terminal:  # a log: one line per binary
        where = build.ensure(lambda c, i, n: err.print(f"  • building {c} {version} ({i}/{n})"))
    else:
        columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err) as bar:
            task = bar.add_task(f"building Kubernetes {version}", total=len(build.COMPONENTS))

            def progress(component: str, i: int, n: int) -> None:
                bar.update(task, completed=i - 1, description=f"building {component} {version} ({i}/{n})")

            where = build.ensure(progress)
            bar.update(task, completed=len(build.COMPONENTS), description=f"built Kubernetes {version}")
    out.print(f"Kubernetes {version}: built in {time.monotonic() - t0:.0f} s into {where}")


def _cluster(ctx: click.Context) -> KubeCluster:
    from podmigrate.cli.lab import get_lab
    from podmigrate.kube.cluster import KubeCluster

    return KubeCluster(get_lab(ctx))


@kube.command("up")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def kube_up(ctx: click.Context, as_json: bool) -> None:
    """Start the control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) on the
    lab's LAN and a kubelet on every node (a lab with --runtime containerd), building the pinned
    release first if needed (idempotent)."""
    cluster = _cluster(ctx)
    with status(f"Kubernetes up in lab {cluster.lab.name!r}") as report:
        st = cluster.up(report)
    emit(st, as_json, _render)


@kube.command("down")
@click.pass_context
def kube_down(ctx: click.Context) -> None:
    """Stop the cluster's components and remove its state (the lab stays)."""
    cluster = _cluster(ctx)
    with status(f"Kubernetes down in lab {cluster.lab.name!r}") as report:
        cluster.down(report)


@kube.command("status")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def kube_status(ctx: click.Context, as_json: bool) -> None:
    """The components that run and the API server's version."""
    emit(_cluster(ctx).status(), as_json, _render)


@kube.command("kubeconfig")
@click.pass_context
def kube_kubeconfig(ctx: click.Context) -> None:
    """Print the admin kubeconfig's path (the API server is on the lab's LAN: use `kube kubectl`)."""
    click.echo(str(_cluster(ctx).kubeconfig()))


@kube.command("kubectl", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def kube_kubectl(ctx: click.Context, args: tuple[str, ...]) -> None:
    """kubectl of the pinned release, on the lab's LAN, as the cluster's admin."""
    p = _cluster(ctx).kubectl(list(args), check=False, timeout=3600)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    sys.exit(p.returncode)


def _render(st: dict[str, Any]) -> None:
    comps = ", ".join(f"{n} {'up' if up else 'DOWN'}" for n, up in st["components"].items())
    out.print(f"Kubernetes {st.get('version') or '(API server not answering)'} at {st['server']} in lab {st['lab']}")
    out.print(f"  {comps}")
