"""``rota status``: holder, queue, residents and per-tenant accounting of groups.

Public for plugins' status commands (``rota k8s status``, ``kubectl rota status``): :func:`print_status`
prints a reply as ``rota status`` does (table, ``--json`` with :func:`status_json`'s schema, or
``--prometheus``), so every status command shows the same thing the same way.
"""

from __future__ import annotations

import asyncio
import json
import os

import click

from rota._generated import rota_v1_pb2 as pb
from rota._ids import check_id
from rota._plugins import plugin_manager
from rota._tenant.local import local_endpoint
from rota._units import format_bytes
from rota.admin import client_timeout, fetch_status
from rota.cli.options import Endpoint
from rota.errors import RotaError

__all__ = ["SCHEMA", "print_status", "prometheus_text", "render_table", "status", "status_json", "store_status"]


def store_status(url: str, group: str = "") -> pb.StatusReply:
    """Status of one or all groups read straight from a state store (``--etcd URL``)."""
    from rota._orchestrator.service import group_info

    store = plugin_manager().hook.rota_store(url=url)
    if store is None:
        raise click.ClickException("--etcd needs the etcd store plugin: pip install rota-orchestrator-etcd")

    async def read() -> list:
        try:
            return await store.load_all()
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                await close()

    groups = asyncio.run(read())
    if group and group not in groups:
        raise click.ClickException(f"group {group!r} does not exist in {url} (known: "
                                   f"{', '.join(sorted(groups)) or 'none'})")
    shown = [groups[group]] if group else [groups[k] for k in sorted(groups)]
    return pb.StatusReply(groups=[group_info(g) for g in shown], orchestrator=f"store {url}")


def prometheus_text(reply: pb.StatusReply) -> str:
    """Prometheus exposition text for a status reply: the group families ``/metrics`` serves, same names,
    labels and values (the event histograms and counters exist only where the orchestrator counts them)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from rota._orchestrator.metrics import GroupsCollector

    registry = CollectorRegistry(auto_describe=True)
    registry.register(GroupsCollector(reply.groups))
    return generate_latest(registry).decode()


def _prefetches(g: pb.GroupInfo) -> list[tuple[str, int]]:
    """A group's prefetch counters by outcome, in one order for the table and the metrics."""
    return [("hit", g.prefetch_hits), ("miss", g.prefetch_misses), ("failed", g.prefetch_failures),
            ("wasted", g.prefetch_wasted)]


def render_table(reply: pb.StatusReply) -> str:
    """Human-readable table: one block per group, one line per tenant."""
    out = []
    for g in reply.groups:
        busy = g.busy_seconds / g.age_seconds if g.age_seconds else 0.0
        out.append(f"group {g.group_id}  [{g.state}]  holder={g.holder or '-'}  token={g.token}  "
                   f"queue={','.join(g.queue) or '-'}  loaded={g.loaded_job or '-'}  switches={g.switches}  "
                   f"busy={busy:.0%}  policy={g.policy}")
        counts = _prefetches(g)
        if any(n for _, n in counts):  # a group that never prefetched shows no line for it
            out.append("  prefetch  " + "  ".join(f"{outcome}={n}" for outcome, n in counts))
        if g.tenants:
            out.append(f"  {'tenant':<24} {'state':<9} {'turns':>6} {'gpu s':>9} {'wait p50':>9} {'wait p99':>9} "
                       f"{'park p50':>9} {'parked':>10} {'host mem':>10} {'residue':>10} {'failed p/r':>10}")
        for t in g.tenants:
            out.append(f"  {t.job_id:<24} {t.state:<9} {t.turns:>6} {t.gpu_seconds:>9.2f} "
                       f"{t.wait_p50_ms:>7.1f}ms {t.wait_p99_ms:>7.1f}ms {t.park_p50_ms:>7.1f}ms "
                       f"{format_bytes(t.parked_bytes):>10} {format_bytes(t.host_bytes):>10} "
                       f"{format_bytes(t.residue_bytes):>10} {f'{t.parks_failed}/{t.restores_failed}':>10}")
            if t.fault:
                out.append(f"    {t.job_id} FAULTED: {t.fault}")
    return "\n".join(out) if out else "no groups yet"


@click.command()
@click.argument("group", required=False, default="")
@click.option("--orchestrator", "endpoint", type=Endpoint(), envvar="ROTA_ORCHESTRATOR",
              help="Orchestrator address (env ROTA_ORCHESTRATOR). Default: this host's embedded one.")
@click.option("--etcd", default="", envvar="ROTA_ETCD",
              help="Read the state straight from etcd at these comma-separated URLs, as the orchestrators "
              "keep it (needs rota-orchestrator-etcd; env ROTA_ETCD). --orchestrator on the command line wins.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--prometheus", is_flag=True, help="Print Prometheus text-format metrics.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds to wait for the orchestrator's answer (default: ROTA_CONNECT_TIMEOUT_S, else 10).")
@click.pass_context
def status(ctx: click.Context, group: str, endpoint: str | None, etcd: str, as_json: bool, prometheus: bool,
           timeout: float | None) -> None:
    """Show holder, queue, loaded job and per-tenant GPU time and waits of GROUP (or all)."""
    if group:
        try:
            check_id("group", group, group_id=group)
        except RotaError as exc:
            raise click.BadParameter(str(exc), param_hint="GROUP") from None
    if etcd and ctx.get_parameter_source("endpoint") != click.core.ParameterSource.COMMANDLINE:
        try:
            reply = store_status(etcd, group)
        except RotaError as exc:
            raise click.ClickException(str(exc)) from None
        print_status(reply, as_json, prometheus)
        return
    if not endpoint:
        endpoint = local_endpoint()
        if not os.path.exists(endpoint[5:]):  # no socket: nothing to ask (a stale one fails the call below)
            raise click.ClickException(f"no orchestrator is running at {endpoint} (the embedded one starts with "
                                       "the first tenant); pass --orchestrator HOST:PORT or set ROTA_ORCHESTRATOR")
    if endpoint.startswith("unix:") and not os.path.exists(endpoint[5:]):
        raise click.ClickException(f"no orchestrator socket at {endpoint[5:]}")
    try:
        reply = fetch_status(endpoint, group, client_timeout(timeout))
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    print_status(reply, as_json, prometheus)


SCHEMA = "rota.status/v1"  # documented in status.schema.json beside this module


def status_json(reply: pb.StatusReply) -> dict:
    """``rota status --json``: every key present, numbers as numbers (see status.schema.json)."""
    def plain(msg: object) -> dict:
        out: dict = {}
        for field in msg.DESCRIPTOR.fields:  # type: ignore[attr-defined]
            value = getattr(msg, field.name)
            if field.message_type is not None:
                out[field.name] = [plain(v) for v in value]
            elif field.label == field.LABEL_REPEATED:
                out[field.name] = list(value)
            else:
                out[field.name] = value
        return out

    return {"schema": SCHEMA, "orchestrator": reply.orchestrator, "groups": [plain(g) for g in reply.groups]}


def print_status(reply: pb.StatusReply, as_json: bool = False, prometheus: bool = False) -> None:
    """Print ``reply`` as ``rota status`` does: JSON, Prometheus text, or the table."""
    if as_json:
        click.echo(json.dumps(status_json(reply), indent=2))
    elif prometheus:
        click.echo(prometheus_text(reply), nl=False)
    else:
        click.echo(render_table(reply))
