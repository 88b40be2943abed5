"""The operator: kopf handlers that run each PodLiveMigration through ``k8s.controller``.

Run with ``kopf run -m podmigrate.k8s.operator --all-namespaces`` (the Deployment's command) or
``podmigrate k8s operator``. Configuration comes from the environment:

- ``PODMIGRATE_REGISTRY``: default registry/prefix for checkpoint images;
- ``PODMIGRATE_ALLOWED_REGISTRIES``: comma-separated ``host[:port][/path-prefix]`` a migration may
  push to and restore from (``k8s.policy``; default: ``PODMIGRATE_REGISTRY`` alone); a
  ``spec.registry`` outside it is refused before anything is frozen;
- ``PODMIGRATE_NAMESPACES``: comma-separated namespaces served (default: all); a migration elsewhere
  is refused;
- ``PODMIGRATE_AGENT_NAMESPACE``, ``PODMIGRATE_AGENT_TOKEN`` (optional: empty sends none);
- ``PODMIGRATE_AGENT_CA``, ``PODMIGRATE_AGENT_CERT``, ``PODMIGRATE_AGENT_KEY``: call the agents over
  https with this client certificate (mutual TLS), their certificates checked against the CA;
  ``PODMIGRATE_AGENT_CHECK_HOSTNAME=0`` accepts any agent certificate of that CA (agents are dialled at
  pod IPs that their certificates cannot name);
- ``PODMIGRATE_METRICS_PORT`` (default 8080; 0 turns the Prometheus endpoint off);
- ``PODMIGRATE_KUBE_SERVER``: talk to this API server instead of the in-cluster one (development).

Create and resume share one handler that reads the record from the live object, so an operator that
died mid-migration resumes where the record says. Deleting a running migration cancels it (the
controller polls for the deletion) and the finalizer's handler rolls back what is left. A migration
that is already terminal is never run again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import kopf
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from podmigrate.k8s import api as k
from podmigrate.k8s import controller, drain
from podmigrate.k8s import evacuation as ev
from podmigrate.k8s.context import K8sRecord
from podmigrate.k8s.crd import GROUP, PLURAL, TERMINAL, VERSION
from podmigrate.k8s.evacuator import Evacuator
from podmigrate.k8s.policy import NAMESPACES_ENV, REGISTRIES_ENV, parse_list

MIGRATIONS = Counter("podmigrate_migrations_total", "Finished migrations by result and mode", ["result", "mode"])
PHASE_SECONDS = Histogram(
    "podmigrate_phase_duration_seconds",
    "Duration of each migration phase",
    ["phase", "mode"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
BLACKOUT_SECONDS = Histogram(
    "podmigrate_blackout_seconds",
    "Service blackout per completed migration",
    ["mode"],
    buckets=(0, 0.1, 0.5, 1, 2, 5, 10, 30),
)
RUNNING = Gauge("podmigrate_migrations_running", "Migrations in progress")

_validate_lock = threading.Lock()  # check-and-set of the per-pod lock within this operator


def config() -> controller.Config:
    env = os.environ
    return controller.Config(
        registry=env.get("PODMIGRATE_REGISTRY", controller.Config.registry),
        agent_namespace=env.get("PODMIGRATE_AGENT_NAMESPACE", controller.Config.agent_namespace),
        agent_token=env.get("PODMIGRATE_AGENT_TOKEN", ""),
        poll_s=float(env.get("PODMIGRATE_POLL_S", controller.Config.poll_s)),
        blackout_poll_s=float(env.get("PODMIGRATE_BLACKOUT_POLL_S", controller.Config.blackout_poll_s)),
        drain_s=float(env.get("PODMIGRATE_DRAIN_S", controller.Config.drain_s)),
        allowed_registries=parse_list(env.get(REGISTRIES_ENV)),
        namespaces=parse_list(env.get(NAMESPACES_ENV)),
        agent_ca=env.get("PODMIGRATE_AGENT_CA", ""),
        agent_cert=env.get("PODMIGRATE_AGENT_CERT", ""),
        agent_key=env.get("PODMIGRATE_AGENT_KEY", ""),
        agent_check_hostname=env.get("PODMIGRATE_AGENT_CHECK_HOSTNAME", "1") not in ("0", "false", "no"),
        seal_master=env.get("PODMIGRATE_SEAL_KEY", ""),
    )


def kube() -> k.KubeAPI:
    return k.KubeAPI(k.KubeConfig.load(os.environ.get("PODMIGRATE_KUBE_SERVER")))


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    settings.persistence.finalizer = "podmigrate.io/finalizer"
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call drowns the phases
    settings.posting.level = logging.WARNING  # the controller posts its own Events; no second copy of logs
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 300
    port = int(os.environ.get("PODMIGRATE_METRICS_PORT", "8080"))
    if port:
        start_http_server(port)
        logger.info(f"metrics on :{port}/metrics")
    hook = int(os.environ.get("PODMIGRATE_WEBHOOK_PORT", "0"))
    if hook:  # kubectl drain -> migration (k8s.drain), with the operator's certificate
        cfg = config()
        api = kube()
        try:
            drain.set_ca_bundle(api, Path(cfg.agent_ca).read_bytes())
        finally:
            api.close()
        drain.serve(hook, cfg.agent_cert, cfg.agent_key, cfg, kube)
        logger.info(f"eviction webhook on :{hook}{drain.PATH}")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    server = os.environ.get("PODMIGRATE_KUBE_SERVER")
    if server:
        return kopf.ConnectionInfo(server=server, token=os.environ.get("PODMIGRATE_KUBE_TOKEN"), insecure=True)
    in_cluster = _in_cluster()
    if in_cluster is not None:
        return in_cluster
    return kopf.login_via_client(**kwargs) if _has_client() else kopf.login_with_service_account(**kwargs)


def _in_cluster() -> kopf.ConnectionInfo | None:
    """The pod's service account, at the address its environment gives, as client-go's in-cluster
    configuration does; kopf's own login dials https://kubernetes.default.svc, which needs cluster DNS."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    token = k.SA_DIR / "token"
    if not (host and port and token.exists()):
        return None
    ns = k.SA_DIR / "namespace"
    return kopf.ConnectionInfo(
        server=f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}",
        ca_path=str(k.SA_DIR / "ca.crt"),
        token=token.read_text().strip(),
        default_namespace=ns.read_text().strip() if ns.exists() else None,
    )


def _has_client() -> bool:
    import importlib.util

    return importlib.util.find_spec("kubernetes") is not None


@contextlib.contextmanager
def session(
    namespace: str, name: str, event: controller.Event, on_phase: Callable[[str, float], None] | None = None
) -> Iterator[controller.Ctx | None]:
    """A controller context built from the live object (never from a handler's possibly stale body);
    None when the object is gone."""
    api = kube()
    cfg = config()
    agents = controller.Agents(api, cfg)
    try:
        live = api.get(k.migrations(namespace, name))
        if live is None:
            yield None
            return
        status = live.get("status") or {}
        rec = cast(K8sRecord, dict(status.get("record") or {}))
        spec = rec.get("spec") or dict(live.get("spec") or {})
        ctx = controller.Ctx(api, agents, cfg, namespace, name, spec, rec, event)
        if on_phase:
            ctx.on_phase = on_phase
        try:
            yield ctx
        finally:
            ctx.flush()
    finally:
        agents.close()
        api.close()


def _events(body: kopf.Body, logger: kopf.Logger) -> controller.Event:
    """Post an Event on the resource and log it."""

    def event(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)
        logger.info(f"{reason}: {message}")

    return event


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, namespace: str | None, name: str, logger: kopf.Logger, **_: Any) -> None:
    assert namespace is not None  # the resource is namespaced
    mode = str(body.get("spec", {}).get("mode", "decoupled"))
    event = _events(body, logger)
    with session(namespace, name, event, lambda p, s: PHASE_SECONDS.labels(p, mode).observe(s)) as ctx:
        if ctx is None or ctx.rec.get("status") in controller.FINISHED:
            return  # never run a finished migration again (a restart must not repeat a move)
        RUNNING.inc()
        try:
            try:
                if "validate" not in ctx.rec.get("done", []):
                    with _validate_lock:  # two migrations of one pod must not both take its lock
                        controller.run(ctx, stop_after="validate")
                rec = controller.run(ctx)
            except controller.Transient as e:
                raise kopf.TemporaryError(str(e), delay=15) from e
        finally:
            RUNNING.dec()
        MIGRATIONS.labels(rec.get("status", "unknown"), mode).inc()
        if rec.get("status") == "completed":
            BLACKOUT_SECONDS.labels(mode).observe(rec.get("blackout_s", 0.0))


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(namespace: str | None, name: str, status: kopf.Status, logger: kopf.Logger, **_: Any) -> None:
    """Roll back what a migration that did not finish left behind; a finished one has nothing left."""
    if status.get("phase") in TERMINAL or not status.get("record") or namespace is None:
        return
    with session(namespace, name, lambda *_a: None) as ctx:
        if ctx is None or ctx.rec.get("status") in controller.FINISHED:
            return
        ok = controller.rollback(ctx)
        if not ok:  # keep the finalizer (and the record) until the rollback succeeds
            raise kopf.TemporaryError("deleted while running: the rollback failed; retrying", delay=30)
        logger.info("deleted while running: rolled back")


@kopf.on.create(GROUP, VERSION, ev.PLURAL)
@kopf.on.resume(GROUP, VERSION, ev.PLURAL)
def evacuate(body: kopf.Body, name: str, logger: kopf.Logger, **_: Any) -> None:
    """Run a NodeEvacuation to its end (``k8s.evacuator``): one PodLiveMigration per pod."""
    api, cfg = kube(), config()
    runner = Evacuator(api, name, cfg, _events(body, logger), poll_s=max(0.05, cfg.poll_s))
    try:
        runner.run()
    finally:
        runner.close()
        api.close()


@kopf.on.event("v1", "nodes")
def node_signs(type: str, body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """A node that shows a sign of going away (``k8s.evacuation.TRIGGERS``) gets one NodeEvacuation;
    its mark is taken off once the node is schedulable and unmarked again."""
    if type == "DELETED":
        return
    name = body["metadata"]["name"]
    now = time.time()
    api = kube()
    try:
        # the live node, not the event's: two events can arrive before the first one's mark is seen
        node = api.get(k.nodes(name))
        if node is None:
            return
        mark = (node["metadata"].get("annotations") or {}).get(ev.ANNOTATION)
        sign = ev.trigger_of(node, ev.triggers(), now)
        if sign is None and mark and not (node.get("spec") or {}).get("unschedulable"):
            api.patch(k.nodes(name), {"metadata": {"annotations": {ev.ANNOTATION: None}}})
        elif sign is not None and not mark:
            key, deadline = sign
            evac = ev.name_for(name, key, now)
            api.patch(k.nodes(name), {"metadata": {"annotations": {ev.ANNOTATION: evac}}})
            spec = {"nodeName": name, "deadline": ev.stamp(deadline), "reason": key}
            obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": ev.KIND, "metadata": {"name": evac}, "spec": spec}
            api.create(ev.path(), obj)
            logger.info(f"{name}: {key}, evacuating by {ev.stamp(deadline)} ({evac})")
    finally:
        api.close()
