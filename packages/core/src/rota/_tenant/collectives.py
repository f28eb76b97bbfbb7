"""Built-in plugin: when a job of several ranks is aborted, abort this rank's collectives.

Why: the ranks of a job wait for each other in collectives (all-gather, reduce-scatter,
barriers). When one rank dies or faults, the others block there until NCCL's watchdog
fires, minutes later, holding their device. The orchestrator ends the job's turn at once
and sends ``abort`` to the surviving ranks; this hook then aborts every
``torch.distributed`` process group of the process, so a rank blocked on a collective
raises instead, and the job's launcher (torchrun, Slurm, a Kubernetes Job) sees it fail
and restarts all ranks together.

Torch is never imported here: a process that has not initialised ``torch.distributed``
has no collectives to abort.
"""

from __future__ import annotations

import logging
import sys

from rota.hookspecs import hookimpl

log = logging.getLogger(__name__)


@hookimpl
def rota_job_aborted(tenant: object, reason: str) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        log.warning("%r: this torch cannot abort process groups; ranks waiting in a collective stay blocked "
                    "until its timeout", tenant)
        return
    try:
        abort()
    except Exception as exc:  # gloo or an already-broken group: nothing more to do
        log.warning("%r: aborting the process groups failed (%s: %s)", tenant, type(exc).__name__, exc)
        return
    log.error("%r: job aborted (%s); its torch.distributed process groups were aborted", tenant, reason)
