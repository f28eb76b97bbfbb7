"""rota plugin of rota-agent: ``rota agent serve|status``, and ``--agent`` on the orchestrator.

Registered under the ``rota`` entry-point group. ``rota agent serve`` runs the node
agent in the foreground. Because the orchestrator's engine (rota-core) knows how to
ask agents to park and restore jobs but core's CLI does not know this package, this
plugin adds ``--agent HOST:PORT`` (repeatable) to ``rota orchestrator serve``; it is
passed on as ``ROTA_AGENTS`` (comma-separated), which the engine reads.

Environment:
    ROTA_AGENT_LISTEN     default of ``rota agent serve --listen`` (0.0.0.0:9001)
    ROTA_AGENT_OP_TIMEOUT default of ``--op-timeout`` (seconds, > 0)
    ROTA_RESIDUE_MAX_BYTES default of ``--residue-max-bytes`` (integer >= 0, 0 = off; 256 MiB)
    ROTA_AGENT            default of ``rota agent status --agent``
    ROTA_AGENTS           agents the orchestrator talks to (also set by ``--agent``)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from typing import Any

import click
import grpc

from rota import hookimpl
from rota.cli.options import Endpoint

log = logging.getLogger(__name__)


@click.group()
def agent() -> None:
    """Run or query the per-node snapshot agent (SnapshotAgentService, port 9001)."""


@agent.command("serve")
@click.option("--listen", default="0.0.0.0:9001", show_default=True, type=Endpoint(), envvar="ROTA_AGENT_LISTEN",
              help="Address to serve on: HOST:PORT or unix:PATH (env ROTA_AGENT_LISTEN).")
@click.option("--op-timeout", type=click.FloatRange(min=0.001), default=300.0, show_default=True,
              envvar="ROTA_AGENT_OP_TIMEOUT", help="Deadline of one Snapshot/Restore; a miss FAULTs the job.")
@click.option("--step-timeout", type=click.FloatRange(min=0.001), default=120.0, show_default=True,
              help="Deadline of one CUDA driver step or one HTTP call of the app_endpoint backend.")
@click.option("--residue-max-bytes", type=click.IntRange(min=0), default=None,
              help="Device bytes a parked job may leave behind (NVML per pid for whole-process parks, the adapters' "
                   "report for app_channel); more FAILs the snapshot and FAULTs the job. 0 = off "
                   "[default: env ROTA_RESIDUE_MAX_BYTES, else 268435456 = 256 MiB].")
def serve_cmd(listen: str, op_timeout: float, step_timeout: float, residue_max_bytes: int | None) -> None:
    """Serve SnapshotAgentService and grpc.health.v1 until SIGINT/SIGTERM."""
    from rota.errors import ConfigError
    from rota_agent._agent import Agent
    from rota_agent.backends import default_backends

    try:
        a = Agent(default_backends(step_timeout_s=step_timeout), op_timeout_s=op_timeout, name=listen,
                  residue_max_bytes=residue_max_bytes)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    asyncio.run(_serve(a, listen))


async def _serve(a: Any, listen: str) -> None:
    from rota_agent._server import serve_agent, shutdown

    server, hs = await serve_agent(a, listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    click.echo(f"rota agent serving on {listen}", err=True)
    await stop.wait()
    await shutdown(a, server, hs)


@agent.command("status")
@click.option("--agent", "endpoint", default="127.0.0.1:9001", show_default=True, type=Endpoint(),
              envvar="ROTA_AGENT", help="Agent to ask (env ROTA_AGENT).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_cmd(endpoint: str, as_json: bool) -> None:
    """Show the agent's jobs and accelerators."""
    from rota._generated import snapshot_agent_pb2 as pb
    from rota._generated import snapshot_agent_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        try:
            st = pb_grpc.SnapshotAgentServiceStub(ch).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError as exc:
            raise click.ClickException(f"agent {endpoint}: {exc.code().name}: {exc.details()}") from None
    from rota_agent._generated import agent_ext_pb2 as ext
    from rota_agent._residue import read

    jobs = []
    for j in st.job_statuses:
        more = read(j, ext.JobStatusExt)
        jobs.append({"job_id": j.job_id, "state": pb.JobState.Name(j.state), "fault": more.fault,
                     "residue_bytes": more.residue.counted_bytes, "residue": dict(more.residue.bytes)})
    accel = [{"id": a.id, "used": a.memory_used_bytes, "total": a.memory_total_bytes}
             for a in st.accelerator_statuses]
    if as_json:
        click.echo(json.dumps({"jobs": jobs, "accelerators": accel}, indent=2))
        return
    for j in jobs:
        left = f"  residue {j['residue_bytes'] / 2**20:.1f} MiB" if j["residue"] else ""
        click.echo(f"{j['job_id']:<32} {j['state']}{left}{'  ' + j['fault'] if j['fault'] else ''}")
    for a_ in accel:
        click.echo(f"{a_['id']:<44} {a_['used'] / 2**30:8.1f} / {a_['total'] / 2**30:.1f} GiB")


def _add_agent_option(cli: click.Group) -> None:
    group = cli.commands.get("orchestrator")
    serve = group.commands.get("serve") if isinstance(group, click.Group) else None
    if serve is None or any(p.name == "agents" for p in serve.params) or serve.callback is None:
        return
    serve.params.append(click.Option(
        ["--agent", "agents"], multiple=True, type=Endpoint(),
        help="A node agent (HOST:PORT) the orchestrator asks to park/restore jobs registered with it; "
             "repeat for each node (env ROTA_AGENTS, comma-separated)."))
    inner = serve.callback

    def callback(agents: tuple[str, ...] = (), **kw: Any) -> Any:
        if agents:
            os.environ["ROTA_AGENTS"] = ",".join(agents)
        return inner(**kw)

    serve.callback = callback


@hookimpl
def rota_cli(cli: click.Group) -> None:
    cli.add_command(agent)
    _add_agent_option(cli)
