"""rota's hook contract: what a plugin may implement, and when rota calls it.

Plugins are distributions that register a module or object under the entry-point
group ``rota`` (``rota plugins`` lists them). Hooks are grouped by side:

* lease side — who holds a group (``rota_acquire``/``rota_release``: a plugin may replace
  the gRPC client; ``rota_store``: where an orchestrator keeps group state, ``rota_etcd``);
* snapshot side — moving a tenant's device state out and back (adapters, agent);
* placement side — where tenants run (``rota_slurm``, ``rota_k8s``);
* registration — policies and CLI commands plugins add;
* lifecycle — events for metrics and tracing.

Heavy types are imported only for type checking, so this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from rota import Gpu
    from rota.orchestrator import GroupStore
    from rota.types import Grant, ParkPlan, ParkResult, Placement, ReleaseInfo, TurnRequest

hookspec = pluggy.HookspecMarker("rota")
hookimpl = pluggy.HookimplMarker("rota")


# ---------------------------------------------------------------- lease side


@hookspec(firstresult=True)
def rota_acquire(request: TurnRequest, tenant: Gpu) -> Grant | None:
    """Block until ``request.job_id`` holds ``request.group_id``; return the grant.

    Called by :meth:`rota.Gpu.acquire` in the tenant process. The default
    implementation talks to the orchestrator the client is connected to; a plugin
    may answer instead (e.g. an in-process lock for tests).

    :param request: job, group, rank, priority and footprint of the caller.
    :param tenant: the client object asking.
    :returns: the :class:`~rota.Grant`, with its fencing token.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def rota_release(grant: Grant, tenant: Gpu) -> ReleaseInfo | None:
    """Give the group named by ``grant`` back.

    Called by :meth:`rota.Gpu.release`. A grant whose token is stale is refused with
    :class:`rota.errors.StaleToken`.

    :param grant: the grant being ended.
    :param tenant: the client object releasing.
    :returns: whether others wait and whether parking was deferred.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def rota_store(url: str) -> GroupStore | None:
    """Open the group-state store named by ``url`` (e.g. ``http://etcd:2379``).

    Called by ``rota orchestrator serve --etcd URL`` and ``rota status --etcd URL``.
    Without any plugin answering, the orchestrator keeps state in memory.

    :param url: comma-separated store endpoints as the user gave them.
    :returns: a :class:`rota.orchestrator.GroupStore`, or None if this plugin does not
        serve that kind of URL.

    Stops at first non-None result.
    """


# ------------------------------------------------------------- snapshot side


@hookspec
def rota_park(tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
    """Move this tenant's device state named by ``plan`` to host memory (or drop it).

    Called in the tenant process when the orchestrator needs the device for another
    job, never while the tenant holds its turn. Every adapter tracking state for
    ``tenant`` parks its own part.

    :param tenant: the client whose state is parked; adapters ignore other tenants.
    :param plan: tags and mode (offload or discard).
    :returns: bytes moved and seconds taken, or None if nothing was tracked.
    """


@hookspec
def rota_restore(tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
    """Bring this tenant's parked state back to the device before its turn starts.

    Called in the tenant process right after a grant whose state had been parked.

    :param tenant: the client whose state is restored.
    :param plan: the tags to restore.
    :returns: bytes moved and seconds taken, or None if nothing was tracked.
    """


@hookspec
def rota_footprint(tenant: Gpu) -> dict[str, int] | None:
    """Report device bytes this tenant holds, per tag (weights, grads, optimizer...).

    Lets the orchestrator skip parking when everything fits on the device.

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

    Called once when the CLI starts. Add commands with ``cli.add_command``.

    :param cli: the top-level ``rota`` click group.
    """


@hookspec
def rota_register_policies(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Contribute scheduling policies to orchestrators.

    Called when an orchestrator starts. ``register(name, factory)`` adds a policy;
    ``factory(**options)`` returns an object with ``choose(queue, tenants, now)``
    (see :mod:`rota.policies`).

    :param register: the callable to register each policy with.
    """


# ----------------------------------------------------------------- lifecycle


@hookspec
def rota_tenant_started(tenant: Gpu) -> None:
    """A tenant connected (``rota.connect`` returned). For metrics and tracing.

    :param tenant: the new client.
    """


@hookspec
def rota_turn_started(tenant: Gpu, grant: Grant) -> None:
    """A turn began: the grant was received and state restored.

    :param tenant: the client holding the group.
    :param grant: the grant of this turn.
    """


@hookspec
def rota_job_aborted(tenant: Gpu, reason: str) -> None:
    """The job of this rank can no longer run as a unit: another of its ranks died or faulted.

    Called once, in a thread of the tenant process, when the orchestrator says so. The
    job's turn has already ended and the group moved on. Adapters that run collectives
    abort them here (e.g. ``rota_fsdp`` aborts the NCCL process group), so that a rank
    blocked waiting for the lost one raises instead of hanging; the client refuses
    further turns (:class:`rota.errors.Faulted`) until every rank is restarted.

    :param tenant: the client of this rank.
    :param reason: which rank was lost and why.
    """


@hookspec
def rota_turn_ended(tenant: Gpu, grant: Grant, seconds: float) -> None:
    """A turn ended: the tenant released the group.

    :param tenant: the client that held the group.
    :param grant: the grant that ended.
    :param seconds: how long the turn lasted.
    """
