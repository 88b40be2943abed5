"""``kubectl drain`` becomes migration: the validating webhook on ``pods/eviction`` (``webhook.yaml``).

An eviction of a pod that opted in (label ``podmigrate.io/drain: migrate``) or that a migration is
moving is answered 429 Too Many Requests, which ``kubectl drain`` (and the eviction API's other
callers) retry every few seconds, while a PodLiveMigration moves the pod: the webhook creates one if
none runs (it lets the operator choose the target, as a NodeEvacuation's would). When the copy has
taken over, the operator deletes the source and the drain's next try finds it gone. A migration that
failed or rolled back lets the eviction through: the drain completes, the state is lost, the
PodLiveMigration says why. Other pods are not held; a PodDisruptionBudget still decides their
evictions, and a migrated pod's copy carries its labels, so the budget sees the copy before the
source goes.

The operator's own eviction is held while an opted-in pod or a migration is left on its node: the
webhook is the operator, and answering nothing (``failurePolicy: Ignore``) would let those pods be
evicted instead of moved.

``review`` decides (pure, over the API); ``serve`` answers ``AdmissionReview`` over https in a thread of
the operator, with the operator's certificate (its SANs name the webhook's Service).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import threading
from typing import Any

from podmigrate.k8s import api as k
from podmigrate.k8s.agents import Config
from podmigrate.k8s.crd import API_VERSION, KIND, TERMINAL

OPT_IN = ("podmigrate.io/drain", "migrate")
PATH = "/evict"
CONFIG_NAME = "podmigrate-eviction"  # the ValidatingWebhookConfiguration whose caBundle the operator sets
RETRY_S = 5


def opted_in(pod: dict[str, Any]) -> bool:
    return (pod["metadata"].get("labels") or {}).get(OPT_IN[0]) == OPT_IN[1]


def migration_of(api: k.KubeAPI, ns: str, pod: str) -> dict[str, Any] | None:
    """The pod's running migration, else its latest finished one, else None."""
    runs = [m for m in api.list(k.migrations(ns)) if (m.get("spec") or {}).get("podName") == pod]
    running = [m for m in runs if (m.get("status") or {}).get("phase") not in TERMINAL]
    if running:
        return dict(running[0])
    runs.sort(key=lambda m: m["metadata"].get("creationTimestamp", ""))
    return dict(runs[-1]) if runs else None


def _hold(message: str) -> dict[str, Any]:
    return {"allowed": False, "status": {"code": 429, "reason": "TooManyRequests", "message": message}}


def _allow(warning: str = "") -> dict[str, Any]:
    return {"allowed": True, **({"warnings": [warning]} if warning else {})}


def review(api: k.KubeAPI, config: Config, request: dict[str, Any], me: dict[str, str]) -> dict[str, Any]:
    """The answer (``response`` without its uid) to one eviction; ``me``: the operator's pod
    (``name``, ``namespace``, ``node``)."""
    ns, name = request.get("namespace", ""), request.get("name", "")
    pod = api.get(k.pods(ns, name))
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return _allow()
    if (ns, name) == (me.get("namespace"), me.get("name")):
        return _own_eviction(api, config, me.get("node", ""))
    if config.namespaces and ns not in config.namespaces:
        return _allow()
    run = migration_of(api, ns, name)
    phase = ((run or {}).get("status") or {}).get("phase")
    if run is not None and phase not in TERMINAL:
        plm = run["metadata"]["name"]
        return _hold(f"podmigrate is moving {ns}/{name} (PodLiveMigration {plm}, {phase or 'Pending'})")
    if phase == "Completed":
        return _hold(f"{ns}/{name} has moved; its source is being removed")
    if run is not None and phase in ("Failed", "RolledBack"):
        msg = (run.get("status") or {}).get("message", "")
        return _allow(f"podmigrate could not move {ns}/{name} ({phase}: {msg}); evicted, its state is lost")
    if not opted_in(pod):
        return _allow()
    if request.get("dryRun"):
        return _allow()  # sideEffects: NoneOnDryRun
    plm = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"generateName": f"drain-{name}-"[:50], "namespace": ns, "labels": {OPT_IN[0]: "eviction"}},
        "spec": {"podName": name},
    }
    made = api.create(k.migrations(ns), plm)
    return _hold(f"podmigrate is moving {ns}/{name} (PodLiveMigration {made['metadata']['name']}); retry")


def _own_eviction(api: k.KubeAPI, config: Config, node: str) -> dict[str, Any]:
    """Held while the node still has pods the operator must move first."""
    if not node:
        return _allow()
    for pod in api.list("/api/v1/pods", field_selector=f"spec.nodeName={node}"):
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") or (config.namespaces and meta["namespace"] not in config.namespaces):
            continue
        run = migration_of(api, meta["namespace"], meta["name"])
        phase = ((run or {}).get("status") or {}).get("phase")
        if (run is not None and phase not in ("Failed", "RolledBack")) or (run is None and opted_in(pod)):
            return _hold(f"podmigrate's operator leaves {node} after {meta['namespace']}/{meta['name']} has moved")
    return _allow()


def admit(api: k.KubeAPI, config: Config, body: dict[str, Any], me: dict[str, str]) -> dict[str, Any]:
    """An ``AdmissionReview`` answered; an error of ours lets the eviction through (as the
    configuration's ``failurePolicy: Ignore`` would) with a warning."""
    request = body.get("request") or {}
    try:
        response = review(api, config, request, me)
    except Exception as e:  # the drain must not hang on podmigrate's failure
        response = _allow(f"podmigrate's eviction webhook failed ({type(e).__name__}: {e}); evicted")
    response["uid"] = request.get("uid", "")
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def set_ca_bundle(api: k.KubeAPI, ca_pem: bytes) -> None:
    """The webhook configuration's caBundle set to the CA of the operator's certificate (what
    cert-manager's CA injector would do), so any way of making the Secret works."""
    import base64

    path = f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{CONFIG_NAME}"
    conf = api.get(path)
    if conf is None:
        return
    bundle = base64.b64encode(ca_pem).decode()
    hooks = conf.get("webhooks") or []
    if all((h.get("clientConfig") or {}).get("caBundle") == bundle for h in hooks):
        return
    for h in hooks:
        h.setdefault("clientConfig", {})["caBundle"] = bundle
    api.patch(path, {"webhooks": hooks})


def serve(port: int, cert: str, key: str, config: Config, make_api: Any) -> threading.Thread:
    """The webhook's https server on ``port``, in a daemon thread with its own event loop."""
    from aiohttp import web

    me = {"name": os.environ.get("POD_NAME", ""), "namespace": os.environ.get("POD_NAMESPACE", ""),
          "node": os.environ.get("NODE_NAME", "")}  # fmt: skip

    async def evict(request: web.Request) -> web.Response:
        body = await request.json()
        api = make_api()
        try:
            out = await asyncio.to_thread(admit, api, config, body, me)
        finally:
            api.close()
        return web.Response(text=json.dumps(out), content_type="application/json")

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    def run() -> None:
        app = web.Application()
        app.router.add_post(PATH, evict)
        web.run_app(app, port=port, ssl_context=ctx, handle_signals=False, print=None)

    t = threading.Thread(target=run, name="eviction-webhook", daemon=True)  # run_app makes its own loop
    t.start()
    return t
