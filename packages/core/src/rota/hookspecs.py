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
* registration — hook specs, policies and CLI commands plugins add;
* lifecycle — events for metrics, tracing and aborting collectives.

Hooks are called through ``pm.hook``; where each implementation must be called on its own (one
plugin's error must not stop the others, or a result must name its plugin), :func:`call_each`
does it. Heavy types are imported only for type checking, so this module costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from rota import Gpu
    from rota.orchestrator import GroupStore, OrchestratorConfig, OrchestratorProtocol
    from rota.types import (
        Grant,
        OrchestratorLink,
        ParkPlan,
        ParkResult,
        Placement,
        ReleaseInfo,
        ReleaseRequest,
        TurnRequest,
    )

hookspec = pluggy.HookspecMarker("rota")
hookimpl = pluggy.HookimplMarker("rota")

__all__ = ["call_each", "hookimpl", "hookspec", "rota_acquire", "rota_add_hookspecs", "rota_cli", "rota_footprint",
           "rota_job_aborted", "rota_orchestrator", "rota_park", "rota_place", "rota_register_policies",
           "rota_release", "rota_restore", "rota_store", "rota_turn_ended", "rota_turn_started"]


def call_each(hook: pluggy.HookCaller, *, on_error: Callable[[str, Exception], None] | None = None,
              **kwargs: Any) -> list[tuple[str, Any]]:
    """Call each implementation of ``hook`` on its own, in ``pm.hook``'s order; return (plugin name, result) pairs.

    For callers that need what ``pm.hook`` does not give: the plugin behind each result (an
    agent backend offered twice names both plugins) or isolation (``rota`` adds every plugin's
    commands; one that raises costs one line, not the CLI). With ``on_error``, an implementation
    that raises is reported as ``on_error(plugin_name, exc)`` and left out; without it the error
    propagates. Results include None; hook wrappers are not called.
    """
    out = []
    for impl in reversed(hook.get_hookimpls()):  # pluggy calls the last registered (and tryfirst) first
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            result = impl.function(*(kwargs[name] for name in impl.argnames))
        except Exception as exc:
            if on_error is None:
                raise
            on_error(impl.plugin_name, exc)
            continue
        out.append((impl.plugin_name, result))
    return out


# ---------------------------------------------------------------- lease side


@hookspec(firstresult=True)
def rota_acquire(request: TurnRequest, link: OrchestratorLink) -> Grant | None:
    """Block until ``request.job_id`` holds ``request.group_id``; return the grant.

    Called by :meth:`rota.Gpu.acquire` in the tenant process. Implemented by core's
    gRPC client, :mod:`rota._tenant.lease` (``trylast``: it talks to the orchestrator
    through ``link``); a plugin may answer first instead (e.g. an in-process lock for
    tests, as core's test_plugins.py does). Everything an implementation needs
    comes in the arguments: it never calls back into the client that asked.

    :param request: job, group, rank, priority, weight, devices and footprint of the caller.
    :param link: the caller's :class:`~rota.types.OrchestratorLink` (``link.stub``, a
        ``rota.v1.RotaService`` stub; ``link.follow(leader)`` when a replica names another leader).
    :returns: the :class:`~rota.Grant`, with its fencing token.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def rota_release(request: ReleaseRequest, link: OrchestratorLink) -> ReleaseInfo | None:
    """Give the group named by ``request.grant`` back.

    Called by :meth:`rota.Gpu.release`, and by :meth:`rota.Gpu.acquire` when restoring the
    parked state at a grant failed (the turn is given back, the state stays parked);
    implemented by core's gRPC client (``trylast``), like :func:`rota_acquire`. A grant whose
    token is stale is refused with :class:`rota.errors.StaleToken`.

    :param request: the grant being ended, with this rank, its footprint and its restore
        seconds at the turn's start.
    :param link: the caller's :class:`~rota.types.OrchestratorLink`, as for :func:`rota_acquire`.
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

    :param config: the orchestrator's settings from the command line (policy, TTLs, capacity, agents).
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
    Implemented by rota_etcd, which answers every URL (an etcd it cannot reach fails when the
    store is used). Without ``--etcd``, the orchestrator keeps state in memory.

    :param url: comma-separated store endpoints as the user gave them.
    :returns: a :class:`rota.orchestrator.GroupStore`; a plugin for another kind of store
        returns None for URLs that are not its own.

    Stops at first non-None result.
    """


# ------------------------------------------------------------- snapshot side


@hookspec
def rota_park(tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
    """Move this tenant's device state named by ``plan`` to host memory (or drop it).

    Called by :class:`rota.Gpu` in the tenant process when the orchestrator sends a park
    command (it needs the device for another job), or through :meth:`rota.Gpu.park` (a node
    agent), never while the tenant holds its turn. Implemented by the per-tenant plugin object each
    ``rota_torch.Tracked`` registers on its Gpu's manager (the tracked state of rota_fsdp,
    rota_megatron and any trainer adapter built on it), by rota_vllm's in-process engine and
    rota_sglang's, by rota_serving's ``EndpointParker`` (served engines), and, for tests, by
    :mod:`rota.testing`'s adapters without torch (``ListState``); each parks its own part of
    ``tenant``. The Tinker service's workers wrap it (a hook wrapper adding the process's NVML
    bytes before each park; rota_torch's last part reads them after it).

    :param tenant: the client whose state is parked; adapters ignore other tenants.
    :param plan: tags and mode (offload or discard).
    :returns: bytes moved and seconds taken, or None if nothing was tracked.
    """


@hookspec
def rota_restore(tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
    """Bring this tenant's parked state back to the device before its turn starts.

    Called by :class:`rota.Gpu` in the tenant process right after a grant whose state had
    been parked, or ahead of it (the orchestrator's prefetch command, or a node agent
    through :meth:`rota.Gpu.restore`); also after a grant on another device than the one
    its resident state is on (a group over several GPUs), to move it there.
    Implemented by the same adapters as :func:`rota_park`.

    :param tenant: the client whose state is restored.
    :param plan: the tags to restore; ``plan.device`` (when set) is where the state goes.
    :returns: bytes moved and seconds taken, or None if nothing was tracked.
    """


@hookspec
def rota_footprint(tenant: Gpu) -> dict[str, int] | None:
    """Report device bytes this tenant holds, per tag (weights, grads, optimizer...).

    Called by :meth:`rota.Gpu.footprint` (what the client reports to the orchestrator); implemented by
    the same objects as :func:`rota_park`, and by the Tinker service's workers (their working set)
    and the base holder of a shared LoRA turn (its gate). Lets the orchestrator skip parking when
    everything fits on the device.

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


@hookspec(historic=True)
def rota_add_hookspecs(pluginmanager: pluggy.PluginManager) -> None:
    """Add a plugin's own hook specs to rota's plugin manager (as pytest's ``pytest_addhooks``).

    Called by every plugin manager rota makes (:func:`rota.plugin_manager`,
    :func:`rota.testing.new_plugin_manager`) before any plugin is registered; historic, so each
    plugin registered later is called with it as it registers. Implemented by rota_agent
    (:mod:`rota_agent.hookspecs`: ``rota_agent_backends``) and rota_serving
    (:mod:`rota_serving.hookspecs`: ``rota_register_with_agent``). Add specs with
    ``pluginmanager.add_hookspecs(module)``.

    :param pluginmanager: the manager being made.
    """


@hookspec
def rota_cli(cli: click.Group) -> None:
    """Add subcommands to the ``rota`` command line.

    Called once by ``rota`` (:mod:`rota.cli`), through :func:`call_each`, the first time a
    command that is not core's is asked for or the command list is shown; implemented by
    the plugins that bring commands (rota_agent, rota_slurm, rota_k8s, rota_k8s_controller,
    rota_vllm, rota_sglang, rota_tinker, rota_demo). Add commands with ``cli.add_command``,
    preferably a :class:`rota.cli.lazy.LazyCommand` stand-in, so that ``rota --help`` lists the
    command without importing it; a plugin never reads another's commands. Two plugins adding
    one name: the one called last keeps it (rota_k8s's fuller ``k8s`` group is ``trylast`` over
    rota_k8s_controller's).

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
def rota_turn_started(tenant: Gpu, grant: Grant) -> None:
    """A turn began: the grant was received and state restored.

    Called by :meth:`rota.Gpu.acquire`; implemented by the Tinker service's workers (their working
    set restarts the allocator's peak, so the turn's own peak is measured).

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

    Called by :meth:`rota.Gpu.release`; implemented by the per-tenant plugin object of
    ``rota_torch.Tracked`` (the trainer adapters' tracked state), which trims the device cache
    after each turn.

    :param tenant: the client that held the group.
    :param grant: the grant that ended.
    :param seconds: how long the turn lasted.
    """
