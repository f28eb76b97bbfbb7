"""``rota orchestrator serve``: run an orchestrator in the foreground."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal

import click
import grpc
import pluggy

from rota._orchestrator.config import OrchestratorConfig
from rota._orchestrator.grpc_server import server_tls
from rota._orchestrator.service import serve
from rota._orchestrator.turns import Orchestrator
from rota._plugins import plugin_manager
from rota.auth import ServerAuth, load_key
from rota.cli.options import ByteSize, Endpoint, Seconds, resident_first_option
from rota.errors import RotaError
from rota.orchestrator import OrchestratorProtocol
from rota.policies import ResidentFirst, available_policies, make_policy

__all__ = ["orchestrator", "serve_cmd"]


log = logging.getLogger(__name__)


@click.group()
def orchestrator() -> None:
    """Run or inspect the orchestrator that decides who holds each group."""


@orchestrator.command("serve")
@click.option("--listen", default=None, type=Endpoint(), envvar="ROTA_LISTEN",
              help="Address to serve on: HOST:PORT or unix:PATH (env ROTA_LISTEN). Default: this user's Unix socket "
              "(ROTA_RUNTIME_DIR, else $XDG_RUNTIME_DIR/rota or /tmp/rota-UID: a 0700 folder, the socket 0600), "
              "where tenants and `rota status` on this host look with nothing configured.")
@click.option("--groups", default="", help="Comma-separated fixed groups; unknown groups are then NOT_FOUND. "
              "Default: groups are created on first use.")
@click.option("--policy", default="fifo", show_default=True,
              help="Who goes next: fifo, priority, fair (weighted GPU-time share), or a plugin's policy.")
@click.option("--max-turn", type=Seconds(), default=0.0, show_default=True,
              help="Seconds a holder may keep a group while others wait before it is asked to yield (0 = no limit).")
@click.option("--ttl", type=Seconds(positive=True), default=10.0, show_default=True,
              help="Seconds without a heartbeat after which a tenant is dead and loses its turn.")
@click.option("--park-timeout", type=Seconds(positive=True), default=120.0, show_default=True,
              help="Seconds a tenant may take to park before it is FAULTED and the group moves on.")
@click.option("--v1-max-turn", type=Seconds(), default=600.0, show_default=True,
              help="Longest turn for v1alpha1-only clients, which send no heartbeats: a holder that vanished "
              "frees the group after this (0 = no limit).")
@click.option("--capacity", type=ByteSize(), default="0", show_default=True,
              help="Device memory per group (e.g. 80GiB). Tenants that fit beside each other are not "
              "parked. 0 = unknown: park every other resident.")
@click.option("--devices", "host_devices", type=click.IntRange(0, 64), default=None,
              help="GPUs of the host whose groups span devices: a tenant's ROTA_DEVICES may name cuda:0..N-1 (and "
              "fake:0..N-1); other names are refused. Default: this host's GPUs (/dev/nvidia0, /dev/nvidia1...), "
              "or 64 on a host without any; set it where this orchestrator serves the GPUs of other hosts.")
@click.option("--residue-allowance", type=ByteSize(), default="256MiB", show_default=True,
              help="Device bytes a parked tenant's reported residue (what its park left behind) may take from the "
              "room of the others; more is its own word and counts for nobody. 0 = reported residue counts for "
              "nobody.")
@resident_first_option()
@click.option("--prefetch/--no-prefetch", default=None,
              help="Restore the next waiter while the holder still runs, when it fits beside the residents "
              "(needs --capacity). Default: on when --capacity is set.")
@click.option("--idle-exit", type=Seconds(), default=0.0, show_default=True,
              help="Exit after this many seconds with no tenants (0 = run until stopped).")
@click.option("--etcd", default="", envvar="ROTA_ETCD",
              help="Keep state in etcd at these comma-separated URLs (needs rota-orchestrator-etcd; env ROTA_ETCD).")
@click.option("--agent", "agents", multiple=True, type=Endpoint(),
              help="A node agent (HOST:PORT, rota-agent) the orchestrator asks to park/restore the jobs registered "
              "with it; repeat for each node (env ROTA_AGENTS, comma-separated). It is shown admin tokens of "
              "audience rota-agent (60 s; orchestrators refuse them) naming this address (other agents refuse "
              "them), over TLS when --tls-cert is given (ROTA_TLS_CA: the agents' CA); a plaintext one beyond "
              "loopback is warned about.")
@click.option("--auth-key", default="", envvar="ROTA_AUTH_KEY", type=click.Path(dir_okay=False),
              help="Check every caller's bearer token against this key (rota token keygen FILE; env ROTA_AUTH_KEY), "
              "on a unix: listener too. A tenant token acts for its own job only; an admin token for all. Required "
              "on a TCP listener unless --insecure.")
@click.option("--tls-cert", default="", type=click.Path(dir_okay=False),
              help="Serve TLS with this certificate (PEM); clients set ROTA_TLS_CA.")
@click.option("--tls-key", default="", type=click.Path(dir_okay=False), help="The private key of --tls-cert (PEM).")
@click.option("--tls-client-ca", default="", type=click.Path(dir_okay=False),
              help="Also require client certificates signed by this CA (mTLS; clients set ROTA_TLS_CERT/KEY).")
@click.option("--metrics-listen", default="", envvar="ROTA_METRICS_LISTEN",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (turn waits and parks as histograms, "
              "grants, holder per group, tenant states; env ROTA_METRICS_LISTEN). Default: none.")
@click.option("--metrics-hash-ids", is_flag=True,
              help="Serve /metrics without a token, every group and job id replaced by h- and 12 hex characters of "
              "an HMAC-SHA256 keyed with --auth-key (stable across restarts). Without this flag an orchestrator with "
              "--auth-key serves /metrics only to an admin token (Authorization: Bearer).")
@click.option("--insecure", is_flag=True,
              help="Serve TCP without checking callers: anyone who can connect may act for any job. Only for "
              "trusted single-team setups and unmodified v1alpha1 clients; a warning is printed at every start.")
def serve_cmd(listen: str | None, groups: str, policy: str, max_turn: float, ttl: float, park_timeout: float,
              v1_max_turn: float, capacity: int, host_devices: int | None, residue_allowance: int,
              resident_first: float, prefetch: bool | None, idle_exit: float,
              etcd: str, agents: tuple[str, ...], auth_key: str, tls_cert: str, tls_key: str, tls_client_ca: str,
              metrics_listen: str, metrics_hash_ids: bool, insecure: bool) -> None:
    """Serve the v1alpha1 orchestrator API and rota.v1 (fencing, sessions, status).

    Without --etcd, state lives in this process (the embedded orchestrator that
    `rota.connect()` starts by itself on a Unix socket when nothing is configured).
    """
    private = listen is None
    if private:
        listen = _private_socket()
    pm = plugin_manager()
    if policy not in available_policies(pm):
        raise click.BadParameter(f"unknown policy {policy!r}; choose one of "
                                 f"{', '.join(sorted(available_policies(pm)))}", param_hint="--policy")
    if resident_first and not capacity:
        raise click.BadParameter(f"{resident_first:g} needs --capacity (without the device's size every other "
                                 "resident is parked at each switch, so nobody stays resident)",
                                 param_hint="--resident-first")
    try:
        key = load_key(auth_key) if auth_key else None
        chosen = make_policy(pm, policy, max_turn_s=max_turn)
        if resident_first:
            chosen = ResidentFirst(chosen, patience_s=resident_first, capacity_bytes=capacity)
        config = OrchestratorConfig(
            groups=tuple(g.strip() for g in groups.split(",") if g.strip()),
            policy=chosen, ttl_s=ttl, park_timeout_s=park_timeout,
            v1_max_turn_s=v1_max_turn, capacity_bytes=capacity, prefetch=prefetch, idle_exit_s=idle_exit,
            devices=host_devices, residue_allowance_bytes=residue_allowance,
            agent_auth_key=key,  # the agents are shown admin tokens made with the same key
            **({"agents": agents} if agents else {}))  # else ROTA_AGENTS
        if tls_cert and config.agents:
            config = dataclasses.replace(config, agent_tls=_agent_tls())
        orch = _orchestrator(pm, config, etcd, listen)
        server_auth, tls = _security(listen, key, tls_cert, tls_key, tls_client_ca, insecure)
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    if metrics_listen:
        _serve_metrics(orch, metrics_listen, server_auth, metrics_hash_ids)
    asyncio.run(_run(orch, listen, server_auth, tls, private=private))


def _private_socket() -> str:
    """This user's socket (the embedded orchestrator's): its folder made or checked 0700; refused while another
    orchestrator serves there."""
    from rota._tenant.local import is_serving, local_endpoint

    try:
        endpoint = local_endpoint()
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    if os.path.exists(endpoint[5:]) and is_serving(endpoint):
        raise click.UsageError(f"an orchestrator already serves at {endpoint} (rota status shows it); stop it, or "
                               "give --listen HOST:PORT or unix:PATH")
    return endpoint


def _agent_tls() -> grpc.ChannelCredentials:
    """The TLS of the links to the node agents: an orchestrator with TLS settings never talks to them in plaintext
    (the tokens it shows them would travel in the clear)."""
    from rota.auth import tls_credentials

    creds = tls_credentials()
    if creds is None:
        raise click.UsageError("this orchestrator serves TLS (--tls-cert), so its links to the node agents use TLS "
                               "too: set ROTA_TLS_CA to the CA that signed the agents' certificates (and "
                               "ROTA_TLS_CERT/ROTA_TLS_KEY where they check clients), and start each agent with "
                               "--tls-cert/--tls-key")
    return creds


def _orchestrator(pm: pluggy.PluginManager, config: OrchestratorConfig, url: str, listen: str
                  ) -> OrchestratorProtocol:
    """A plugin's orchestrator (``rota_orchestrator``, e.g. rota_etcd's HA replica), else core's own orchestrator over
    the store ``url`` names (``rota_store``), or over memory without ``url``."""
    orch = pm.hook.rota_orchestrator(config=config, url=url, listen=listen)
    if orch is not None:
        return orch
    store = pm.hook.rota_store(url=url) if url else None
    if url and store is None:
        raise click.UsageError(f"--etcd {url} needs the etcd store plugin: pip install rota-orchestrator-etcd")
    return Orchestrator(config, store, name=f"embedded@{listen}")


def _serve_metrics(orch: OrchestratorProtocol, listen: str, auth: ServerAuth, hash_ids: bool) -> None:
    """``/metrics`` of ``orch`` (of the groups it leads now) on ``HOST:PORT``: with a key only for an admin
    token, or ids hashed (:mod:`rota.metrics_http`)."""
    from rota._orchestrator.metrics import OrchestratorMetrics
    from rota.metrics_http import serve_metrics, warn_if_exposed

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not HOST:PORT (e.g. 0.0.0.0:9464)", param_hint="--metrics-listen")

    metrics = OrchestratorMetrics(lambda: dict(orch.groups), leading=lambda: orch.leading)
    orch.report_metrics_to(metrics)
    try:
        serve_metrics(metrics.registry, host.strip("[]"), int(port), auth=auth, hash_ids=hash_ids)
    except OSError as exc:
        raise click.BadParameter(f"cannot serve metrics on {listen}: {exc.strerror}",
                                 param_hint="--metrics-listen") from None
    how = "ids hashed" if hash_ids else "admin token needed" if auth.key else "no token checked"
    click.echo(f"rota orchestrator: metrics at http://{listen}/metrics ({how})", err=True)
    warning = warn_if_exposed(host)
    if warning:
        click.echo(f"rota orchestrator: {warning}", err=True)


def _security(listen: str, key: bytes | None, tls_cert: str, tls_key: str, tls_client_ca: str,
              insecure: bool) -> tuple[ServerAuth, grpc.ServerCredentials | None]:
    """Who may call this server, and its TLS; refuses an open TCP listener unless --insecure says so."""
    local = listen.startswith("unix:")
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("give --tls-cert and --tls-key together (the certificate and its private key)")
    if tls_client_ca and not tls_cert:
        raise click.UsageError("--tls-client-ca needs --tls-cert/--tls-key: client certificates are checked over TLS")
    if insecure and key:
        raise click.UsageError("--insecure and --auth-key contradict each other: drop --insecure to check tokens")
    if not local and not key and not insecure:
        raise click.UsageError(f"--listen {listen} is reachable over the network and no caller would be checked: "
                               "give --auth-key FILE (make one with `rota token keygen FILE`), or --insecure to "
                               "serve anyone who can connect")
    try:
        tls = server_tls(tls_cert, tls_key, tls_client_ca) if tls_cert else None
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    if insecure:
        click.echo(f"rota orchestrator: WARNING: --insecure: anyone who can reach {listen} may acquire, release or "
                   "evict any job; use --auth-key in shared clusters", err=True)
    # --auth-key means every listener: on a Unix socket too, a caller without a token is refused
    return ServerAuth(key=key, local=local and key is None, insecure=insecure), tls




async def _run(orch: OrchestratorProtocol, listen: str, server_auth: ServerAuth, tls: grpc.ServerCredentials | None,
               *, private: bool = False) -> None:
    if private:  # the socket is made 0600 as it is bound (no moment when others could connect), then checked
        umask = os.umask(0o177)
        try:
            server = await serve(orch, listen, auth=server_auth, tls=tls)
        finally:
            os.umask(umask)
        os.chmod(listen[5:], 0o600)
    else:
        server = await serve(orch, listen, auth=server_auth, tls=tls)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, orch.stopped.set)
    click.echo(f"rota orchestrator serving on {listen} (policy {orch.config.policy.name})", err=True)
    await orch.stopped.wait()
    await orch.stop()
    await server.stop(grace=1.0)
