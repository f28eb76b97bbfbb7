"""A WorkloadChannel's registration, before the agent admits it: who the caller is (:class:`Caller`), the
checks that read nothing outside this process (:func:`vet`), and the proof of which process the channel stands
for and that it owns its endpoints (:func:`prove`, which reads /proc and so runs on a worker thread).

:meth:`rota_agent._agent.Agent.admit` then adds the channel to its job, on the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from dataclasses import dataclass

from rota import proc as _proc
from rota.auth import Principal
from rota.config import check_id, shown
from rota.errors import InvalidArgument, PermissionDenied
from rota.wire import snapshot_agent_pb2 as pb
from rota_agent._door import Proof
from rota_agent.backends import check_tag_names
from rota_agent.backends.app_endpoint import check_endpoints, check_owned
from rota_agent.errors import BadBackendConfig
from rota_agent_client.extension import ext

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the owner of a registration that proved nothing (no token checked, no pid door)


@dataclass(frozen=True)
class Caller:
    """Who opened a WorkloadChannel: the verified principal, and the process the pid door proved."""

    principal: Principal
    keyed: bool = False  # the agent checks tokens, so the principal is a real credential
    proof: Proof | None = None

    @property
    def owner(self) -> str:
        """Whom a registration belongs to (see :mod:`rota_agent._agent`'s docs)."""
        if self.keyed:
            p = self.principal
            return "admin" if p.admin else f"token {p.group}/{p.job}"
        return f"uid {self.proof.uid}" if self.proof is not None else ANONYMOUS


@dataclass(frozen=True)
class Registration:
    """A WorkloadChannel's registration on its way in: vetted (:func:`vet`), then proven (:func:`prove`:
    ``pid``/``start``), then admitted (:meth:`rota_agent._agent.Agent.admit`)."""

    job_id: str
    group: str
    caller: Caller
    backend: str
    capabilities: pb.WorkloadCapabilities
    app: int
    endpoints: tuple[str, ...]
    pid_claim: int
    pid: int = 0
    start: int = 0


def vet(msg: pb.RegisterWorkload, caller: Caller, backend: str, backends: Collection[str], *, pid_claim: int = 0,
        more: ext.RegisterWorkloadExt | None = None) -> Registration:
    """The checks that read nothing outside this process: ids, the caller's right, capabilities, backend and
    endpoints; cheap, so a caller without the right costs the agent no /proc reads."""
    job_id, group = msg.job_id, msg.group
    check_id("job_id", job_id, job_id=job_id, group_id=group)
    check_id("group", group, job_id=job_id, group_id=group)
    if not caller.principal.may_act_for(group, job_id):
        raise PermissionDenied(f"{caller.principal.subject} may not register job {job_id!r} of group {group!r}; "
                               "use a token issued for that job (rota token issue --group G --job J)",
                               job_id=job_id, group_id=group)
    caps = _check_capabilities(msg)
    if backend not in backends:
        choices = ", ".join(sorted(backends))
        raise BadBackendConfig(f"job {job_id!r} asked for backend {shown(backend)} (metadata rota-backend); "
                               f"choose one of {choices}", job_id=job_id)
    app, endpoints = 0, ()
    if more is not None and (more.app or more.endpoints):
        endpoints = check_endpoints(more.app, more.endpoints, f"registration of job {job_id!r}", job_id)
        app = more.app
    if backend == "app_endpoint" and not endpoints:
        raise BadBackendConfig(f"job {job_id!r} asked for backend app_endpoint but registered no endpoints; "
                               "register the servers' base URLs (rota_agent.WorkloadClient(..., app=, "
                               "endpoints=))", job_id=job_id)
    return Registration(job_id, group, caller, backend, caps, app, endpoints, pid_claim)


def prove(reg: Registration) -> Registration:
    """Which process the channel stands for, and that it owns the endpoints it registered: reads /proc, which
    may take a while on a busy node, so the servicer calls this on a worker thread. Touches no agent state."""
    job_id = reg.job_id
    pid, start = _proven_pid(job_id, reg.caller.proof, reg.pid_claim)
    if reg.endpoints:
        check_owned(job_id, reg.endpoints, {pid: start} if pid else {}, f"registration of job {job_id!r}")
    if reg.backend == "cuda" and not pid:
        raise BadBackendConfig(f"job {job_id!r} asked for the cuda backend, which parks its process, but did not "
                               "prove which process it is: register through the agent's pid door (ROTA_AGENT="
                               "unix:<socket dir>/agent.sock, or ROTA_AGENT_PROOF=<socket dir>/pid.sock)",
                               job_id=job_id)
    return dataclasses.replace(reg, pid=pid, start=start)


def _check_capabilities(msg: pb.RegisterWorkload) -> pb.WorkloadCapabilities:
    caps = msg.capabilities
    valid = {pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD}
    for m in [*caps.supported_modes, *([caps.default_mode] if caps.default_mode else [])]:
        if m not in valid:
            raise InvalidArgument(f"job {msg.job_id!r} registered mode {m}, which is not SUSPEND_MODE_OFFLOAD "
                                  "(1) or SUSPEND_MODE_DISCARD (2)", job_id=msg.job_id)
    if caps.supported_modes and caps.default_mode and caps.default_mode not in caps.supported_modes:
        raise InvalidArgument(f"job {msg.job_id!r}: default_mode {caps.default_mode} is not among its "
                              f"supported_modes {sorted(set(caps.supported_modes))}", job_id=msg.job_id)
    check_tag_names(caps.tags, f"job {msg.job_id!r}: capabilities.tags", msg.job_id)
    return caps


def _proven_pid(job_id: str, proof: Proof | None, claim: int) -> tuple[int, int]:
    """(pid, start time) the new channel stands for: the door's, or a claimed descendant of it; (0, 0) if none."""
    if proof is None:
        if claim:
            log.info("job %s: ignoring metadata rota-pid=%d: the channel did not come through the pid door",
                     job_id, claim)
        return 0, 0
    if claim and claim != proof.pid:
        start = _proc.start_time(claim)
        if start is not None and _proc.descends(claim, {proof.pid}) and _proc.uid(claim) == proof.uid:
            return claim, start
        log.warning("job %s: ignoring metadata rota-pid=%d: it is not pid %d (proven by the door) or a "
                    "descendant of it running as the same uid", job_id, claim, proof.pid)
    return proof.pid, proof.start
