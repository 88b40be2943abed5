"""``podmigrate k8s ...``: the CRD manifest, the operator and the node agent (``podmigrate.k8s``)."""

from __future__ import annotations

import click


@click.group("k8s")
def k8s_group() -> None:
    """Kubernetes: the CRD manifest, the operator and the node agent (see deploy/kubernetes/)."""


@k8s_group.command("crd")
def k8s_crd() -> None:
    """Print the PodLiveMigration CRD manifest (deploy/kubernetes/base/crd.yaml is this output)."""
    from podmigrate.k8s import manifests

    click.echo(manifests.crd_yaml(), nl=False)


@k8s_group.command("operator", context_settings={"ignore_unknown_options": True})
@click.argument("kopf_args", nargs=-1, type=click.UNPROCESSED)
def k8s_operator(kopf_args: tuple[str, ...]) -> None:
    """Run the operator: `kopf run --standalone --all-namespaces -m podmigrate.k8s.operator [KOPF_ARGS]`."""
    import os
    import sys

    args = ["kopf", "run", "--standalone", "--all-namespaces", "-m", "podmigrate.k8s.operator", *kopf_args]
    os.execv(sys.executable, [sys.executable, "-m", *args])


@k8s_group.command("agent", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("agent_args", nargs=-1, type=click.UNPROCESSED)
def k8s_agent(agent_args: tuple[str, ...]) -> None:
    """Run the node agent (the DaemonSet's process); `podmigrate k8s agent --help` lists its options."""
    from podmigrate.k8s import agent

    agent.main(list(agent_args))


@k8s_group.command("secrets")
@click.option(
    "--dir",
    "directory",
    required=True,
    type=click.Path(file_okay=False),
    help="Keeps the agents' CA and the sealing key (0600): the same directory gives the same ones.",
)
@click.option("--namespace", default="podmigrate-system", show_default=True)
def k8s_secrets(directory: str, namespace: str) -> None:
    """Print the Secrets the manifests mount (agent and operator TLS, sealing key), made without
    cert-manager: `podmigrate k8s secrets --dir DIR | kubectl apply -f -`."""
    import json
    from pathlib import Path

    from podmigrate.k8s import secrets

    items = secrets.manifests(Path(directory), namespace)
    click.echo(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
