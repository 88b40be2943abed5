"""The lab's phases, one module per concern, bound to the plan table's phase names.

``engine.plans`` says which phases a migration runs; ``implementations`` says which code runs for
each name, given what moves (``scope``) and how (``mode``): checkpoint, for one, is a container's
dump, a lazy dump or a whole pod's. Every undo works from the record alone and is idempotent.
"""

from __future__ import annotations

from podmigrate.engine.phases import container as c
from podmigrate.engine.phases import lazy, parked, pod, traffic
from podmigrate.engine.phases.context import Ctx, Report
from podmigrate.engine.phases.validate import validate
from podmigrate.engine.plans import PhaseName as P
from podmigrate.engine.runner import Phase, phase_table

__all__ = ["PROBE_FROM", "Ctx", "Report", "implementations"]

_COMMON = phase_table(
    Phase(P.VALIDATE, validate),
    Phase(P.PAGE_SERVER, c.page_server, c.delete_target_copy, artifact=True),
    Phase(P.CHECKPOINT, c.checkpoint, c.undo_checkpoint),
    Phase(P.PUSH, c.push, c.undo_push, artifact=True),
    Phase(P.PULL, c.pull, c.delete_target_copy, artifact=True),
    Phase(P.TRANSFER, c.transfer, c.delete_target_copy, artifact=True),
    Phase(P.RESTORE, c.restore, c.undo_restore),
    Phase(P.STOP, c.stop, c.undo_stop),
    Phase(P.START, c.start_fresh, c.undo_restore),
    Phase(P.CUTOVER, traffic.cutover, traffic.undo_cutover),
    Phase(P.VERIFY, c.verify),
    # a streamed restore's memory, copied in by a local lazy-pages daemon: all of it before verify
    Phase(P.PAGES, lazy.local_pages),
    Phase(P.CLEANUP, traffic.cleanup),
)
_LAZY = phase_table(
    Phase(P.CHECKPOINT, lazy.lazy_checkpoint, lazy.undo_lazy_checkpoint),
    # undone only when the restore itself failed: once it succeeded the migration is committed
    Phase(P.RESTORE, lazy.lazy_restore, c.undo_restore),
    # the copy already runs: the source is only a page server now, nothing to route back to
    Phase(P.CUTOVER, traffic.cutover),
    Phase(P.PAGES, lazy.lazy_pages),
)
_POD = phase_table(
    Phase(P.CHECKPOINT, pod.pod_checkpoint, pod.undo_pod_checkpoint),
    Phase(P.TRANSFER, pod.pod_transfer, c.delete_target_copy, artifact=True),
    Phase(P.RESTORE, pod.pod_restore, c.undo_restore),
)
_PARK = phase_table(
    Phase(P.VALIDATE, parked.validate_park),
    Phase(P.PARK, parked.park, parked.undo_park),
    Phase(P.CLEANUP, parked.cleanup_park),
)
_PARKED = phase_table(
    Phase(P.VALIDATE, parked.validate_restore),
    Phase(P.CLEANUP, parked.cleanup_restore),
)
# the phases that start the probe: from here on the service may stop answering
PROBE_FROM = (P.CHECKPOINT, P.STOP)


def implementations(scope: str, mode: str) -> dict[P, Phase[Ctx]]:
    special = {"pod": _POD, "parked": _PARKED}.get(scope) or {"lazy": _LAZY, "park": _PARK}.get(mode, {})
    return {**_COMMON, **special}
