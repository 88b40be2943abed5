"""Service addresses on a segment every node shares (``Cluster.shared_segment``: the hosts' ``l2``
router), where whoever holds an address answers ARP for it.

The source gives its addresses up just before its freeze (its interface goes down in its network
namespace): a frozen source's kernel would still answer ARP, and a lazy dump's source is no longer
Podman's container to find at the cutover, when the copy announces them (``Router.switch``). The
packets lost meanwhile are the freeze's own, which TCP sends again to the copy. Undone, the source
takes them back (its interface up, gratuitous ARP).
"""

from __future__ import annotations

import time

from podmigrate.engine.phases.context import Ctx


def withdraw_source(ctx: Ctx) -> None:
    rec = ctx.rec
    if not ctx.lab.shared_segment:
        return
    for ip in rec["service_addresses"]:
        ctx.agent(rec["source"] or "").post("/v1/l2/withdraw", {"address": ip})
    rec["withdrawn_at"] = time.time()


def take_back(ctx: Ctx) -> str:
    """The source's addresses back to it, if it gave them up; what was done."""
    rec = ctx.rec
    if not rec.get("withdrawn_at"):
        return ""
    router = ctx.traffic()
    for ip in rec["service_addresses"]:
        router.switch(ip, rec["source"] or "")
    return f"; {', '.join(rec['service_addresses'])} announced from {rec['source']} again"
