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
    import subprocess

    sys.exit(subprocess.call(_cluster(ctx).kubectl_argv(list(args))))


@kube.command("install")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds to wait for the pods to roll out.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def kube_install(ctx: click.Context, timeout: float, as_json: bool) -> None:
    """Install podmigrate on the lab's cluster as a user does: its image from deploy/Containerfile
    (buildah) into the lab registry, the Secrets (`k8s secrets`), `kubectl apply -k` of
    deploy/kubernetes/lab (the base manifests with the lab's registry); waits for the operator and
    the agents to run."""
    from podmigrate.kube import install

    cluster = _cluster(ctx)
    with status(f"installing podmigrate on lab {cluster.lab.name!r}'s cluster") as report:
        pods = install.install(cluster, report, timeout)
    emit(pods, as_json, _render_pods)


@kube.command("uninstall")
@click.pass_context
def kube_uninstall(ctx: click.Context) -> None:
    """Delete what `kube install` applied (every PodLiveMigration with the CRD)."""
    from podmigrate.kube import install

    cluster = _cluster(ctx)
    with status(f"uninstalling podmigrate from lab {cluster.lab.name!r}") as report:
        install.uninstall(cluster, report)


@kube.command("example")
@click.option("--heap-mb", type=int, default=None, help="The heap server's heap (the example's: 256).")
@click.option("--namespace", default="default", show_default=True)
@click.pass_context
def kube_example(ctx: click.Context, heap_mb: int | None, namespace: str) -> None:
    """Apply deploy/kubernetes/examples/heapsrv.yaml with the lab's image (the pod, its Service and
    PodDisruptionBudget); then `kube kubectl -- apply -f deploy/kubernetes/examples/podlivemigration.yaml`."""
    from podmigrate.kube import install

    install.apply_example(_cluster(ctx), namespace, heap_mb)


def _render(st: dict[str, Any]) -> None:
    comps = ", ".join(f"{n} {'up' if up else 'DOWN'}" for n, up in st["components"].items())
    out.print(f"Kubernetes {st.get('version') or '(API server not answering)'} at {st['server']} in lab {st['lab']}")
    out.print(f"  {comps}")


def _render_pods(pods: dict[str, Any]) -> None:
    for name, p in pods.items():
        out.print(f"  {name}: {p['phase']}{'' if p['ready'] else ' (not ready)'} on {p['node']}")
