"""``rota orchestrator serve``: run an orchestrator in the foreground."""

from __future__ import annotations

import asyncio
import logging
import signal

import click

from rota._engine import Orchestrator, OrchestratorConfig
from rota._plugins import plugin_manager
from rota._service import serve
from rota.cli.options import ByteSize, Endpoint, resident_first_option
from rota.errors import RotaError
from rota.policies import ResidentFirst, available_policies, make_policy

log = logging.getLogger(__name__)


@click.group()
def orchestrator() -> None:
    """Run or inspect the orchestrator that decides who holds each group."""


@orchestrator.command("serve")
@click.option("--listen", default="127.0.0.1:50051", show_default=True, type=Endpoint(), envvar="ROTA_LISTEN",
              help="Address to serve on: HOST:PORT or unix:PATH (env ROTA_LISTEN).")
@click.option("--groups", default="", help="Comma-separated fixed groups; unknown groups are then NOT_FOUND. "
              "Default: groups are created on first use.")
@click.option("--policy", default="fifo", show_default=True,
              help="Who goes next: fifo, priority, fair (weighted GPU-time share), or a plugin's policy.")
@click.option("--max-turn", type=float, default=0.0, show_default=True,
              help="Seconds a holder may keep a group while others wait before it is asked to yield (0 = no limit).")
@click.option("--ttl", type=float, default=10.0, show_default=True,
              help="Seconds without a heartbeat after which a tenant is dead and loses its turn.")
@click.option("--park-timeout", type=float, default=120.0, show_default=True,
              help="Seconds a tenant may take to park before it is FAULTED and the group moves on.")
@click.option("--v1-max-turn", type=float, default=0.0, show_default=True,
              help="Longest turn for v1alpha1-only clients, which send no heartbeats (0 = no limit).")
@click.option("--capacity", type=ByteSize(), default="0", show_default=True,
              help="Device memory per group (e.g. 80GiB). Tenants that fit beside each other are not "
              "parked. 0 = unknown: park every other resident.")
@resident_first_option()
@click.option("--prefetch/--no-prefetch", default=None,
              help="Restore the next waiter while the holder still runs, when it fits beside the residents "
              "(needs --capacity). Default: on when --capacity is set.")
@click.option("--idle-exit", type=float, default=0.0, show_default=True,
              help="Exit after this many seconds with no tenants (0 = run until stopped).")
@click.option("--etcd", default="", envvar="ROTA_ETCD",
              help="Keep state in etcd at these comma-separated URLs (needs rota-orchestrator-etcd; env ROTA_ETCD).")
def serve_cmd(listen: str, groups: str, policy: str, max_turn: float, ttl: float, park_timeout: float,
              v1_max_turn: float, capacity: int, resident_first: float, prefetch: bool | None, idle_exit: float,
              etcd: str) -> None:
    """Serve the v1alpha1 orchestrator API and rota.v1 (fencing, sessions, status).

    Without --etcd, state lives in this process (the embedded orchestrator that
    `rota.connect()` starts by itself on a Unix socket when nothing is configured).
    """
    pm = plugin_manager()
    if policy not in available_policies(pm):
        raise click.BadParameter(f"unknown policy {policy!r}; choose one of "
                                 f"{', '.join(sorted(available_policies(pm)))}", param_hint="--policy")
    if resident_first and not capacity:
        raise click.BadParameter(f"{resident_first:g} needs --capacity (without the device's size every other "
                                 "resident is parked at each switch, so nobody stays resident)",
                                 param_hint="--resident-first")
    store = None
    try:
        if etcd:
            store = pm.hook.rota_store(url=etcd)
            if store is None:
                raise click.UsageError("--etcd needs the etcd store plugin: pip install rota-orchestrator-etcd")
        chosen = make_policy(pm, policy, max_turn_s=max_turn)
        if resident_first:
            chosen = ResidentFirst(chosen, patience_s=resident_first, capacity_bytes=capacity)
        config = OrchestratorConfig(
            groups=tuple(g.strip() for g in groups.split(",") if g.strip()),
            policy=chosen, ttl_s=ttl, park_timeout_s=park_timeout,
            v1_max_turn_s=v1_max_turn, capacity_bytes=capacity, prefetch=prefetch, idle_exit_s=idle_exit)
        make = getattr(store, "make_orchestrator", None)  # e.g. rota_etcd's HA replica
        engine = make(config, listen=listen) if make else Orchestrator(config, store, name=f"embedded@{listen}")
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    asyncio.run(_run(engine, listen))




async def _run(engine: Orchestrator, listen: str) -> None:
    server = await serve(engine, listen)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, engine.stopped.set)
    click.echo(f"rota orchestrator serving on {listen} (policy {engine.config.policy.name})", err=True)
    await engine.stopped.wait()
    await engine.stop()
    await server.stop(grace=1.0)
