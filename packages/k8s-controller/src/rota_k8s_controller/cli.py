"""The in-cluster commands: ``rota k8s controller`` and ``rota k8s install-key``.

rota-scheduler-k8s adds both to its ``rota k8s`` group; installed alone (as the rota
image is), this package adds a ``rota k8s`` group holding only these two.
"""

from __future__ import annotations

import signal
from typing import Any

import click

from rota.cli.options import Endpoint
from rota.errors import RotaError

__all__ = ["controller_cmd", "install_key_cmd", "k8s"]


@click.command("controller")
@click.option("--orchestrator", "endpoint", type=Endpoint(), required=True, envvar="ROTA_ORCHESTRATOR",
              help="Orchestrator to send Evict to (env ROTA_ORCHESTRATOR).")
@click.option("--namespace", "namespaces", multiple=True, metavar="NS",
              help="Watch tenant pods of this namespace (repeatable; one watch each). Default: all namespaces.")
@click.option("--auth-key", default="", envvar="ROTA_AUTH_KEY", type=click.Path(dir_okay=False),
              help="The orchestrator's auth key (env ROTA_AUTH_KEY): each job's token is issued with it into the "
              "Secret rota-token-JOB of the job's namespace, and Evict carries an admin token made with it.")
@click.option("--token-ttl", default="30d", show_default=True,
              help="Lifetime of job tokens; a pod reads ROTA_TOKEN when it starts, so make it outlast the jobs.")
@click.option("--max-priority", type=click.IntRange(0, 1000), default=0, show_default=True,
              help="The highest priority a job's token may allow: its pods' ROTA_PRIORITY up to this (an "
              "orchestrator with --auth-key refuses a priority above its token's).")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), help="Use this kubeconfig instead of the "
              "in-cluster service account.")
@click.option("--context", help="kubeconfig context.")
@click.option("--watch-timeout", type=click.IntRange(1, 3600), default=60, show_default=True,
              help="Seconds per watch request before it is renewed (pending evictions retry then too).")
@click.option("--health-listen", default="", metavar="HOST:PORT",
              help="Serve GET /healthz here for the kubelet's probes: 200 while every watched namespace had a "
              "list, watch event or renewal within 3 x --watch-timeout, else 503. Default: none.")
def controller_cmd(endpoint: str, namespaces: tuple[str, ...], auth_key: str, token_ttl: str, max_priority: int,
                   kubeconfig: str | None, context: str | None, watch_timeout: int, health_listen: str) -> None:
    """Watch tenant pods; issue each job its token; release the turn of jobs whose pods are deleted, evicted or lost."""
    from rota.auth import load_key, parse_ttl
    from rota_k8s_controller.controller import Controller, TokenSecrets, core_api_from_environment, grpc_evictor
    from rota_k8s_controller.names import dns_label_ok

    for ns in namespaces:
        if not dns_label_ok(ns):
            raise click.BadParameter(f"{ns!r} is not a namespace name (a DNS-1123 label)", param_hint="--namespace")
    try:
        key = load_key(auth_key) if auth_key else None
        ttl = parse_ttl(token_ttl)
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        api = core_api_from_environment(kubeconfig, context)
    except Exception as exc:
        raise click.ClickException(f"no Kubernetes configuration: {exc}") from None
    tokens = TokenSecrets(api, key, ttl_s=ttl, max_priority=max_priority) if key else None
    ctl = Controller(api, grpc_evictor(endpoint, key=key), namespaces=namespaces, tokens=tokens,
                     watch_timeout=watch_timeout)
    if health_listen:
        _serve_health(health_listen, ctl, 3.0 * watch_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: ctl.stop())
    click.echo(f"rota k8s controller: watching pods labelled timeslice.io/group in "
               f"{', '.join(namespaces) or 'all namespaces'}, evicting through {endpoint}"
               f"{', issuing job tokens' if tokens else ' without credentials (no --auth-key)'}", err=True)
    ctl.run()


def _serve_health(listen: str, ctl: Any, max_age_s: float) -> None:
    """``--health-listen``: /healthz of ``ctl`` (a Controller) on HOST:PORT."""
    from rota_k8s_controller._health import serve_health

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not HOST:PORT (e.g. 0.0.0.0:8081)", param_hint="--health-listen")
    try:
        serve_health(host.strip("[]"), int(port), ctl.out_of_touch_s, max_age_s)
    except OSError as exc:
        raise click.BadParameter(f"cannot listen on {listen}: {exc.strerror}", param_hint="--health-listen") from None


@click.command("install-key")
@click.argument("source", type=click.Path(dir_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
def install_key_cmd(source: str, dest: str) -> None:
    """Copy the auth key SOURCE (a mounted Secret) to DEST as an owner-only file (an init container's job).

    Kubernetes mounts Secrets through links and group-readable, which rota's servers
    refuse; DEST (mode 0600, in a memory emptyDir) is what --auth-key then reads.
    """
    from rota_k8s_controller._keys import install_key

    try:
        install_key(source, dest)
    except RotaError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"rota: auth key installed at {dest}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def k8s() -> None:
    """rota on Kubernetes, in-cluster side: the pod controller and the auth key's init container."""


k8s.add_command(controller_cmd)
k8s.add_command(install_key_cmd)
