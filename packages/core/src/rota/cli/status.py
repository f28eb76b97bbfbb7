"""``rota status``: holder, queue, residents and per-tenant accounting of groups."""

from __future__ import annotations

import asyncio
import json
import os

import click

from rota._generated import rota_v1_pb2 as pb
from rota._ids import check_id
from rota._local import is_serving, local_endpoint
from rota._plugins import plugin_manager
from rota._units import format_bytes
from rota.admin import fetch_status
from rota.cli.options import Endpoint
from rota.errors import RotaError

__all__ = ["SCHEMA", "prometheus_text", "render_table", "status", "status_json", "store_status"]


def store_status(url: str, group: str = "") -> pb.StatusReply:
    """Status of one or all groups read straight from a state store (``--etcd URL``)."""
    from rota._service import group_info

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
    """Prometheus exposition text for a status reply (turns, waits, parks, busy time)."""
    lines = []

    def metric(name: str, kind: str, helptext: str, rows: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP rota_{name} {helptext}")
        lines.append(f"# TYPE rota_{name} {kind}")
        for labels, value in rows:
            lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"rota_{name}{{{lab}}} {value}")

    groups = list(reply.groups)
    metric("group_busy_seconds_total", "counter", "Seconds some tenant held the group.",
           [({"group": g.group_id}, g.busy_seconds) for g in groups])
    metric("group_switches_total", "counter", "Turns handed to a different tenant.",
           [({"group": g.group_id}, g.switches) for g in groups])
    metric("group_waiters", "gauge", "Jobs waiting for the group.",
           [({"group": g.group_id}, len(g.queue)) for g in groups])
    metric("group_prefetches_total", "counter", "Restores ahead of the grant: hit (the grant found the job "
           "restored), miss (the grant still restored it), failure (the prefetch's restore failed), wasted "
           "(parked again before its grant).",
           [({"group": g.group_id, "outcome": outcome}, n) for g in groups for outcome, n in _prefetches(g)])
    rows = [(g, t) for g in groups for t in g.tenants]
    metric("tenant_turns_total", "counter", "Turns granted to the tenant.",
           [({"group": g.group_id, "job": t.job_id}, t.turns) for g, t in rows])
    metric("tenant_gpu_seconds_total", "counter", "Seconds the tenant held the group.",
           [({"group": g.group_id, "job": t.job_id}, t.gpu_seconds) for g, t in rows])
    metric("tenant_wait_p99_ms", "gauge", "99th percentile of recent queue waits.",
           [({"group": g.group_id, "job": t.job_id}, t.wait_p99_ms) for g, t in rows])
    metric("tenant_park_p99_ms", "gauge", "99th percentile of recent parks.",
           [({"group": g.group_id, "job": t.job_id}, t.park_p99_ms) for g, t in rows])
    metric("tenant_parked_bytes", "gauge", "Bytes of the tenant's last park.",
           [({"group": g.group_id, "job": t.job_id}, t.parked_bytes) for g, t in rows])
    metric("tenant_host_bytes", "gauge", "Host memory holding the tenant's parked state.",
           [({"group": g.group_id, "job": t.job_id}, t.host_bytes) for g, t in rows])
    metric("tenant_residue_bytes", "gauge", "Device bytes the tenant's last park left behind.",
           [({"group": g.group_id, "job": t.job_id}, t.residue_bytes) for g, t in rows])
    return "\n".join(lines) + "\n"


def _prefetches(g: pb.GroupInfo) -> list[tuple[str, int]]:
    """A group's prefetch counters by outcome, in one order for the table and the metrics."""
    return [("hit", g.prefetch_hits), ("miss", g.prefetch_misses), ("failure", g.prefetch_failures),
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
                       f"{'park p50':>9} {'parked':>10} {'host mem':>10} {'residue':>10}")
        for t in g.tenants:
            out.append(f"  {t.job_id:<24} {t.state:<9} {t.turns:>6} {t.gpu_seconds:>9.2f} "
                       f"{t.wait_p50_ms:>7.1f}ms {t.wait_p99_ms:>7.1f}ms {t.park_p50_ms:>7.1f}ms "
                       f"{format_bytes(t.parked_bytes):>10} {format_bytes(t.host_bytes):>10} "
                       f"{format_bytes(t.residue_bytes):>10}")
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
@click.pass_context
def status(ctx: click.Context, group: str, endpoint: str | None, etcd: str, as_json: bool, prometheus: bool) -> None:
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
        _show(reply, as_json, prometheus)
        return
    if not endpoint:
        endpoint = local_endpoint()
        if not is_serving(endpoint):
            raise click.ClickException(f"no orchestrator is running at {endpoint} (the embedded one starts with "
                                       "the first tenant); pass --orchestrator HOST:PORT or set ROTA_ORCHESTRATOR")
    if endpoint.startswith("unix:") and not os.path.exists(endpoint[5:]):
        raise click.ClickException(f"no orchestrator socket at {endpoint[5:]}")
    try:
        reply = fetch_status(endpoint, group)
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    _show(reply, as_json, prometheus)


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


def _show(reply: pb.StatusReply, as_json: bool, prometheus: bool) -> None:
    if as_json:
        click.echo(json.dumps(status_json(reply), indent=2))
    elif prometheus:
        click.echo(prometheus_text(reply), nl=False)
    else:
        click.echo(render_table(reply))
