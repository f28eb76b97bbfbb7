"""rota's hook contract: what a plugin may implement, and when rota calls it.

Plugins are distributions that register a module or object under the entry-point
group ``rota`` (``rota plugins`` lists them). Each hook's docstring says who calls it
and who implements it. Hooks are grouped by side:

* lease side — who holds a group (``rota_acquire``/``rota_release``, answered by core's
  gRPC client unless a plugin answers first);
* orchestrator side — what ``rota orchestrator serve`` serves (``rota_orchestrator``) and
  where group state lives (``rota_store``); rota_etcd implements both;
* snapshot side — moving a tenant's device state out and back (trainer and serving adapters);
* placement side — where tenants run (``rota_place``: rota_slurm, rota_k8s);
* registration — policies and CLI commands plugins add;
* lifecycle — events for metrics, tracing and aborting collectives.

Heavy types are imported only for type checking, so this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from rota import Gpu
    from rota.orchestrator import GroupStore, OrchestratorConfig, OrchestratorProtocol
    from rota.types import Grant, ParkPlan, ParkResult, Placement, ReleaseInfo, TurnRequest

hookspec = pluggy.HookspecMarker("rota")
hookimpl = pluggy.HookimplMarker("rota")

__all__ = ["hookimpl", "hookspec", "rota_acquire", "rota_cli", "rota_footprint", "rota_job_aborted",
           "rota_orchestrator", "rota_park", "rota_place", "rota_register_policies", "rota_release", "rota_restore",
           "rota_store", "rota_tenant_started", "rota_turn_ended", "rota_turn_started"]


# ---------------------------------------------------------------- lease side


@hookspec(firstresult=True)
def rota_acquire(request: TurnRequest, tenant: Gpu) -> Grant | None:
    """Block until ``request.job_id`` holds ``request.group_id``; return the grant.

    Called by :meth:`rota.Gpu.acquire` in the tenant process. Implemented by core's
    gRPC client (``trylast``: it talks to the orchestrator the client is connected to);
    a plugin may answer first instead (e.g. an in-process lock for tests).

    :param request: job, group, rank, priority and footprint of the caller.
    :param tenant: the client object asking.
    :returns: the :class:`~rota.Grant`, with its fencing token.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def rota_release(grant: Grant, tenant: Gpu) -> ReleaseInfo | None:
    """Give the group named by ``grant`` back.

    Called by :meth:`rota.Gpu.release`; implemented by core's gRPC client (``trylast``),
    like :func:`rota_acquire`. A grant whose token is stale is refused with
    :class:`rota.errors.StaleToken`.

    :param grant: the grant being ended.
    :param tenant: the client object releasing.
    :returns: whether others wait and whether parking was deferred.

    Stops at first non-None result.
    """


# -------------------------------------------------------- orchestrator side


@hookspec(firstresult=True)
def rota_orchestrator(config: OrchestratorConfig, url: str, listen: str) -> OrchestratorProtocol | None:
    """Build the orchestrator that ``rota orchestrator serve`` serves on ``listen``.

    Called once by ``rota orchestrator serve``; implemented by rota_etcd, which answers
    when ``url`` is given with an HA replica that elects a leader through etcd. When no
    plugin answers, core serves its own :class:`rota.orchestrator.Orchestrator` with the
    state in memory, or, with ``url``, in the store :func:`rota_store` opens.

    :param config: the engine settings from the command line (policy, TTLs, capacity, agents).
    :param url: the store URL of ``--etcd`` (comma-separated endpoints); empty without it.
    :param listen: the address the server listens on (HOST:PORT or unix:PATH).
    :returns: an object of :class:`rota.orchestrator.OrchestratorProtocol`, or None.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def rota_store(url: str) -> GroupStore | None:
    """Open the group-state store named by ``url`` (e.g. ``http://etcd:2379``).

    Called by ``rota status --etcd URL`` (it reads the state without an orchestrator) and
    by ``rota orchestrator serve --etcd URL`` when no :func:`rota_orchestrator` answered.
    Implemented by rota_etcd. Without ``--etcd``, the orchestrator keeps state in memory.

    :param url: comma-separated store endpoints as the user gave them.
    :returns: a :class:`rota.orchestrator.GroupStore`, or None if this plugin does not
        serve that kind of URL.

    Stops at first non-None result.
    """


# ------------------------------------------------------------- snapshot side


@hookspec
def rota_park(tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
    """Move this tenant's device state named by ``plan`` to host memory (or drop it).

    Called by :class:`rota.Gpu` in the tenant process when the orchestrator sends a park
    command (it needs the device for another job), or through :meth:`rota.Gpu.park` (a node
    agent), never while the tenant holds its turn. Implemented by ``rota_torch.Tracked`` (the tracked
    state of rota_fsdp, rota_megatron and any trainer adapter built on it), by rota_vllm's in-process
    engine and rota_sglang's, and by rota_serving's ``EndpointParker`` (served engines); each parks its
    own part of ``tenant``.

    :param tenant: the client whose state is parked; adapters ignore other tenants.
    :param plan: tags and mode (offload or discard).
    :returns: bytes moved and seconds taken, or None if nothing was tracked.
    """


@hookspec
def rota_restore(tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
    """Bring this tenant's parked state back to the device before its turn starts.

    Called by :class:`rota.Gpu` in the tenant process right after a grant whose state had
    been parked, or ahead of it (the orchestrator's prefetch command, or a node agent
    through :meth:`rota.Gpu.restore`).
    Implemented by the same adapters as :func:`rota_park`.

    :param tenant: the client whose state is restored.
    :param plan: the tags to restore.
    :returns: bytes moved and seconds taken, or None if nothing was tracked.
    """


@hookspec
def rota_footprint(tenant: Gpu) -> dict[str, int] | None:
    """Report device bytes this tenant holds, per tag (weights, grads, optimizer...).

    Called by :meth:`rota.Gpu.footprint` (what the client reports to the orchestrator); implemented by the
    adapters and the Tinker service. Lets the orchestrator skip parking when everything
    fits on the device.

    :param tenant: the client asking.
    :returns: bytes per tag; results of all adapters are summed per tag.
    """


# ------------------------------------------------------------ placement side


@hookspec(firstresult=True)
def rota_place(request: TurnRequest, scheduler: str) -> Placement | None:
    """Decide where a tenant of ``request.group_id`` runs under ``scheduler``.

    Called by ``rota k8s tenant`` (scheduler ``"k8s"``, answered by rota_k8s) when it
    renders a tenant's pod. rota_slurm answers ``"slurm"`` for other callers; rota itself
    places Slurm jobs through the SPANK plugin, not through this hook.

    :param request: the tenant to place.
    :param scheduler: ``"slurm"``, ``"k8s"`` or another plugin's name.
    :returns: the placement, or None if this plugin does not serve ``scheduler``.

    Stops at first non-None result.
    """


# --------------------------------------------------------------- registration


@hookspec
def rota_cli(cli: click.Group) -> None:
    """Add subcommands to the ``rota`` command line.

    Called once by ``rota`` (:mod:`rota.cli`) when the CLI starts; implemented by the
    plugins that bring commands (rota_agent, rota_slurm, rota_k8s, rota_vllm, rota_sglang,
    rota_tinker). Add commands with ``cli.add_command``.

    :param cli: the top-level ``rota`` click group.
    """


@hookspec
def rota_register_policies(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Contribute scheduling policies to orchestrators.

    Called by :func:`rota.policies.available_policies` (``rota orchestrator serve
    --policy``, ``rota k8s`` values); implemented by :mod:`rota.policies` (fifo, priority,
    fair) and by any plugin with policies of its own. ``register(name, factory)`` adds a
    policy; ``factory(**options)`` returns an object with ``choose(queue, tenants, now)``
    (see :mod:`rota.policies`).

    :param register: the callable to register each policy with.
    """


# ----------------------------------------------------------------- lifecycle


@hookspec
def rota_tenant_started(tenant: Gpu) -> None:
    """A tenant connected (``rota.connect`` returned). For metrics and tracing.

    Called by the :class:`rota.Gpu` constructor; no plugin in this repository implements it.

    :param tenant: the new client.
    """


@hookspec
def rota_turn_started(tenant: Gpu, grant: Grant) -> None:
    """A turn began: the grant was received and state restored.

    Called by :meth:`rota.Gpu.acquire`; no plugin in this repository implements it.

    :param tenant: the client holding the group.
    :param grant: the grant of this turn.
    """


@hookspec
def rota_job_aborted(tenant: Gpu, reason: str) -> None:
    """The job of this rank can no longer run as a unit: another of its ranks died or faulted.

    Called once by :class:`rota.Gpu`, in a thread of the tenant process, when the
    orchestrator says so. The job's turn has already ended and the group moved on.
    Implemented by core itself (a built-in plugin aborts every ``torch.distributed``
    process group of the process), so that a rank blocked waiting for the lost one raises
    instead of hanging; the client refuses further turns (:class:`rota.errors.Faulted`)
    until every rank is restarted.

    :param tenant: the client of this rank.
    :param reason: which rank was lost and why.
    """


@hookspec
def rota_turn_ended(tenant: Gpu, grant: Grant, seconds: float) -> None:
    """A turn ended: the tenant released the group.

    Called by :meth:`rota.Gpu.release`; implemented by ``rota_torch.Tracked`` (the trainer
    adapters' tracked state), which trims the device cache after each turn.

    :param tenant: the client that held the group.
    :param grant: the grant that ended.
    :param seconds: how long the turn lasted.
    """
