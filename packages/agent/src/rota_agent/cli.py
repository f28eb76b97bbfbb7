"""``rota agent serve|status``: the node agent in the foreground, and a query of a running one.

The orchestrator's side, ``rota orchestrator serve --agent``, is core's. Each option's
environment variable is named in its ``--help``. Imported only when one of these commands
runs (:mod:`rota_agent.plugin` lists ``rota agent`` without importing it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
from typing import Any

import click
import grpc
from click.core import ParameterSource

from rota.cli.options import ByteSize, Endpoint

log = logging.getLogger(__name__)


@click.group()
def agent() -> None:
    """Run or query the per-node snapshot agent (SnapshotAgentService, port 9001)."""


@agent.command("serve")
@click.option("--listen", default="127.0.0.1:9001", show_default=True, type=Endpoint(), envvar="ROTA_AGENT_LISTEN",
              help="Address to serve on: HOST:PORT or unix:PATH (env ROTA_AGENT_LISTEN). Served with --auth-key "
                   "or --insecure; without either the agent serves only its Unix sockets, mode 0600 (its owner's "
                   "jobs), and a TCP --listen is refused.")
@click.option("--auth-key", default="", envvar="ROTA_AUTH_KEY", type=click.Path(dir_okay=False),
              help="The orchestrator's key file (env ROTA_AUTH_KEY): every caller, on loopback and on the Unix "
                   "socket too, must show a token made with it. A tenant token acts for its own job; the "
                   "orchestrator's admin token for all.")
@click.option("--tls-cert", default="", type=click.Path(dir_okay=False),
              help="Serve --listen over TLS with this certificate (PEM); the orchestrator then sets ROTA_TLS_CA. "
                   "Use it wherever the orchestrator has TLS settings: its tokens travel on this link.")
@click.option("--tls-key", default="", type=click.Path(dir_okay=False), help="The private key of --tls-cert (PEM).")
@click.option("--tls-client-ca", default="", type=click.Path(dir_okay=False),
              help="Also require client certificates signed by this CA (mTLS).")
@click.option("--insecure", is_flag=True,
              help="Serve a non-loopback --listen without checking callers: anyone who can connect may park, "
                   "restore or list any job. A warning is printed at every start.")
@click.option("--name", "names", multiple=True, metavar="ADDRESS", envvar="ROTA_AGENT_NAME",
              help="An address the orchestrator reaches this agent by (its --agent entry, e.g. node1:9001); "
                   "repeatable (env ROTA_AGENT_NAME, space-separated). The orchestrator's tokens name the agent "
                   "they are for, and this agent takes only those naming one of its addresses: these, --listen, "
                   "its agent.sock, and for a wildcard --listen (0.0.0.0:PORT) this host's names and addresses.")
@click.option("--socket-dir", default=None, envvar="ROTA_AGENT_SOCKET_DIR",
              help="Directory of the agent's Unix sockets: agent.sock (the same service) and pid.sock (the pid "
                   "door, through which tenants prove which process they are). '' = none. [default: "
                   "/run/rota-agent as root, else $XDG_RUNTIME_DIR/rota-agent or /tmp/rota-agent-UID]")
@click.option("--op-timeout", type=click.FloatRange(min=0.001), default=300.0, show_default=True,
              envvar="ROTA_AGENT_OP_TIMEOUT", help="Deadline of one Snapshot/Restore; a miss FAULTs the job.")
@click.option("--step-timeout", type=click.FloatRange(min=0.001), default=120.0, show_default=True,
              help="Deadline of one CUDA driver step (the cuda backend).")
@click.option("--http-timeout", type=click.FloatRange(min=0.001), default=30.0, show_default=True,
              envvar="ROTA_AGENT_HTTP_TIMEOUT",
              help="Deadline of one HTTP call of the app_endpoint backend to a tenant's server, connect to last "
                   "byte (env ROTA_AGENT_HTTP_TIMEOUT); a server that never answers fails its own job's operation "
                   "then. Raise it for engines whose sleep or wake takes longer.")
@click.option("--forget-after", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds a job whose WorkloadChannels all closed stays listed (its fault, its parked state) "
                   "before the agent forgets it.")
@click.option("--residue-max-bytes", type=ByteSize(), default=None,
              help="Device bytes a parked job may leave behind (NVML per pid for whole-process parks, the adapters' "
                   "report for app_channel); more FAILs the snapshot and FAULTs the job. 0 = off "
                   "A size (256MiB, 1GB, 1000000) [default: env ROTA_RESIDUE_MAX_BYTES, else 256 MiB].")
@click.option("--metrics-listen", default="", metavar="HOST:PORT",
              help="Serve Prometheus /metrics here (parks and restores, their seconds, bytes moved, jobs by state, "
                   "residue per job). With --auth-key only to an admin token (Authorization: Bearer), unless "
                   "--metrics-hash-ids; bind it where only your Prometheus reaches.")
@click.option("--metrics-hash-ids", is_flag=True,
              help="Serve /metrics without a token, every group and job id replaced by h- and 12 hex characters of "
                   "an HMAC-SHA256 keyed with --auth-key.")
def serve_cmd(listen: str, auth_key: str, tls_cert: str, tls_key: str, tls_client_ca: str, insecure: bool,
              names: tuple[str, ...], socket_dir: str | None, op_timeout: float, step_timeout: float,
              http_timeout: float, forget_after: float,
              residue_max_bytes: int | None, metrics_listen: str, metrics_hash_ids: bool) -> None:
    """Serve SnapshotAgentService and grpc.health.v1 until SIGINT/SIGTERM."""
    from rota import plugin_manager
    from rota.auth import plaintext_beyond_loopback
    from rota.errors import ConfigError
    from rota.rpc import server_tls
    from rota_agent._agent import Agent
    from rota_agent._server import agent_names, default_socket_dir
    from rota_agent.backends import available_backends

    if bool(tls_cert) != bool(tls_key) or (tls_client_ca and not tls_cert):
        raise click.UsageError("give --tls-cert and --tls-key together (--tls-client-ca needs them)")
    try:
        tls = server_tls(tls_cert, tls_key, tls_client_ca) if tls_cert else None
        explicit = click.get_current_context().get_parameter_source("listen") != ParameterSource.DEFAULT
        socket_dir = default_socket_dir() if socket_dir is None else socket_dir
        auth, listen = _server_auth(listen, auth_key, insecure, explicit)
        if auth.key is not None:
            bad = [n for n in names if not n or len(n) > 512 or not n.isprintable() or " " in n]
            if bad:
                raise click.BadParameter(f"{bad[0]!r} is not an address (HOST:PORT or unix:PATH, at most 512 "
                                         "characters)", param_hint="--name")
            auth = dataclasses.replace(auth, agent_names=agent_names(listen, socket_dir, names))
            if listen and tls is None and plaintext_beyond_loopback(listen):
                click.echo(f"rota agent: WARNING: --listen {listen} is plaintext: whoever can read this network reads "
                           "the tokens its callers show (the orchestrator's are valid 60 s, at this agent only); "
                           "give --tls-cert/--tls-key and the orchestrator --tls-cert (ROTA_TLS_CA: this agent's CA)",
                           err=True)
        backends = available_backends(plugin_manager(), step_timeout_s=step_timeout,  # every plugin's
                                      http_timeout_s=http_timeout)
        a = Agent(backends, op_timeout_s=op_timeout, name=listen or "unix", residue_max_bytes=residue_max_bytes,
                  keep_closed_s=forget_after)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if metrics_listen:
        _serve_metrics(a, metrics_listen, auth, metrics_hash_ids)
    if not listen and not socket_dir:
        raise click.UsageError("--socket-dir '' leaves nothing to serve without --auth-key or --insecure: give a "
                               "--socket-dir, or --auth-key to serve --listen")
    asyncio.run(_serve(a, listen, auth, socket_dir, tls))


def _serve_metrics(a: Any, listen: str, auth: Any, hash_ids: bool) -> None:
    """``/metrics`` of agent ``a`` on ``HOST:PORT`` (a thread of its own): ids behind an admin token when the
    agent checks tokens, or hashed (:mod:`rota.metrics_http`)."""
    from rota.metrics_http import serve_metrics, warn_if_exposed
    from rota_agent._metrics import AgentMetrics

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not HOST:PORT (e.g. 0.0.0.0:9464)", param_hint="--metrics-listen")
    metrics = AgentMetrics(lambda: a.jobs)
    try:
        serve_metrics(metrics.registry, host.strip("[]"), int(port), auth=auth, hash_ids=hash_ids)
    except OSError as exc:
        raise click.BadParameter(f"cannot serve metrics on {listen}: {exc.strerror}",
                                 param_hint="--metrics-listen") from None
    a.metrics = metrics
    click.echo(f"rota agent: metrics at http://{listen}/metrics", err=True)
    warning = warn_if_exposed(host)
    if warning:
        click.echo(f"rota agent: {warning}", err=True)


def _server_auth(listen: str, auth_key: str, insecure: bool, explicit: bool) -> tuple[Any, str]:
    """Who may call the agent, and the --listen it serves ("" = none): token holders on every listener
    (--auth-key); anyone who connects (--insecure); else only its owner, on its 0600 Unix sockets."""
    from rota.auth import AGENT_AUDIENCE, AUDIENCE, ServerAuth, load_key

    if insecure and auth_key:
        raise click.UsageError("--insecure and --auth-key contradict each other: drop --insecure to check tokens")
    if auth_key:  # tenants' tokens, and the orchestrator's short ones for agents
        return ServerAuth(key=load_key(auth_key), audiences=(AUDIENCE, AGENT_AUDIENCE)), listen
    if insecure:
        click.echo(f"rota agent: WARNING: --insecure: anyone who can reach {listen} or the agent's sockets may park, "
                   "restore or list any job on this node; use --auth-key in shared clusters", err=True)
        return ServerAuth(insecure=True), listen
    if explicit and not listen.startswith("unix:"):
        raise click.UsageError(f"--listen {listen}: without --auth-key the agent serves only its Unix sockets "
                               "(mode 0600: its owner's jobs). Give --auth-key FILE (the orchestrator's key; make "
                               "one with `rota token keygen FILE`) to serve TCP, or --insecure to serve anyone who "
                               "can connect")
    click.echo("rota agent: no --auth-key: serving only this user's Unix sockets (mode 0600), no TCP port; give "
               "--auth-key to serve other users and the orchestrator over TCP", err=True)
    return ServerAuth(local=True), listen if explicit else ""


async def _serve(a: Any, listen: str, auth: Any, socket_dir: str, tls: Any = None) -> None:
    from rota.errors import RotaError
    from rota_agent._server import serve_agent, shutdown

    try:
        served = await serve_agent(a, listen, auth=auth, socket_dir=socket_dir or None, tls=tls,
                                   private=auth.local)
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    where = " and ".join(w for w in (listen, socket_dir) if w)
    click.echo(f"rota agent serving on {where} ({'tokens checked' if auth.key else 'no tokens checked'}"
               f"{', TLS' if tls is not None else ''})", err=True)
    await stop.wait()
    await shutdown(a, served)


@agent.command("status")
@click.option("--agent", "endpoint", default="127.0.0.1:9001", show_default=True, type=Endpoint(),
              envvar="ROTA_AGENT", help="Agent to ask (env ROTA_AGENT).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_cmd(endpoint: str, as_json: bool) -> None:
    """Show the agent's jobs and accelerators."""
    from rota.auth import channel
    from rota.wire import snapshot_agent_pb2 as pb
    from rota.wire import snapshot_agent_pb2_grpc as pb_grpc

    with channel(endpoint) as ch:  # ROTA_TOKEN; TLS with ROTA_TLS_CA (an agent with --tls-cert)
        try:
            st = pb_grpc.SnapshotAgentServiceStub(ch).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError as exc:
            raise click.ClickException(f"agent {endpoint}: {exc.code().name}: {exc.details()}") from None
    from rota_agent_client.extension import ext, read

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

