"""The ``serve`` command shared by ``rota vllm serve`` and ``rota sglang serve``.

Who calls it: ``rota_vllm.plugin`` and ``rota_sglang.plugin``, each with its
own engine-command builder and version check. It only parses and validates flags,
then delegates to :func:`rota_serving.serve_app`.

Environment (fallbacks of the flags):
    ROTA_SERVE_LISTEN   --listen (default 127.0.0.1:8000)
    ROTA_GROUP, ROTA_TENANT, ROTA_ORCHESTRATOR   as for any tenant (rota.connect)
    ROTA_AGENT          node agent to register with (optional; rota-agent-client answers the hook)
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from rota import ParkMode
from rota.cli.options import ByteSize, Endpoint
from rota.errors import RotaError

if TYPE_CHECKING:  # the supervisor (the rota client, grpc) loads when a command runs, not when ``rota --help`` lists
    from rota_serving.endpoint import EndpointClient

log = logging.getLogger(__name__)

Builder = Callable[..., list[str]]  # (engine_args, port, python, *, sleep_mode) -> command


def _listen(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from rota_serving.supervisor import check_listen

    try:
        check_listen(value, f"--listen (or ROTA_SERVE_LISTEN)={value!r}")
    except RotaError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def make_serve(app: str, build: Builder, env: dict[str, str], check: Callable[[EndpointClient], Any],
               engine_help: str, *, backups: dict[str, str] | None = None,
               client_factory: Callable[[str, str, float], EndpointClient] | None = None) -> click.Command:
    """A click ``serve`` command for ``app``.

    ``backups`` (name -> help): adds ``--backup`` (the first name is the default), passed to ``build`` and
    ``client_factory(backup, base_url, timeout_s)``, for an engine that can keep its weights more than one way.
    """

    @click.command("serve", context_settings={"ignore_unknown_options": False})
    @click.option("--listen", default="127.0.0.1:8000", show_default=True, envvar="ROTA_SERVE_LISTEN",
                  callback=_listen, help="Where rota's proxy serves clients (env ROTA_SERVE_LISTEN).")
    @click.option("--group", envvar="ROTA_GROUP", help="Group to share (env ROTA_GROUP; default 'default').")
    @click.option("--tenant", envvar="ROTA_TENANT", help="Job id of this engine (env ROTA_TENANT).")
    @click.option("--orchestrator", envvar="ROTA_ORCHESTRATOR", type=Endpoint(),
                  help="Orchestrator HOST:PORT (env ROTA_ORCHESTRATOR; default: the embedded one).")
    @click.option("--agent", envvar="ROTA_AGENT", type=Endpoint(),
                  help="Node agent HOST:PORT to register with (env ROTA_AGENT; optional).")
    @click.option("--mode", type=click.Choice(["offload", "discard"]),
                  help="Force the park mode: offload keeps weights on host, discard drops them (RL: the trainer "
                       "pushes fresh ones). Default: what the orchestrator/agent asks (offload).")
    @click.option("--footprint", type=ByteSize(), default="0",
                  help="Device memory of the awake engine (e.g. 60GiB) for residency-aware switching; "
                       "0 = unknown: parked whenever another tenant needs the group.")
    @click.option("--idle-release", type=click.FloatRange(min=0), default=0.5, show_default=True,
                  help="Seconds without requests before the turn is given back.")
    @click.option("--ready-timeout", type=click.FloatRange(min=0.001), default=900.0, show_default=True,
                  help="Seconds to wait for the engine's /health.")
    @click.option("--engine-port", type=click.IntRange(0, 65535), default=0, show_default=True,
                  help="The engine's internal port on 127.0.0.1 (0 = a free one).")
    @click.option("--python", "python", help="Interpreter that runs the engine (default: this one).")
    @click.option("--sleep-mode/--no-sleep-mode", default=True, show_default=True,
                  help="Pass the engine's memory-saving flag (vLLM --enable-sleep-mode, SGLang "
                       "--enable-memory-saver). Off only where the platform refuses it (vLLM on CPU).")
    @click.option("--dry-run", is_flag=True, help="Print the engine command and environment as JSON; start nothing.")
    @click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
    def serve(listen: str, group: str | None, tenant: str | None, orchestrator: str | None, agent: str | None,
              mode: str | None, footprint: int, idle_release: float, ready_timeout: float, engine_port: int,
              python: str | None, sleep_mode: bool, dry_run: bool, engine_args: tuple[str, ...],
              backup: str | None = None) -> None:
        from rota.rpc import free_port
        from rota_serving.supervisor import ServeConfig, serve_app

        try:
            port = engine_port or free_port()
            extra = {"backup": backup} if backups else {}
            command = build(engine_args, port, python, sleep_mode=sleep_mode, **extra)
        except RotaError as exc:
            raise click.UsageError(str(exc)) from None
        if dry_run:
            click.echo(json.dumps({"command": command, "env": env, "engine": f"http://127.0.0.1:{port}", **extra,
                                   "listen": listen}, indent=2))
            return
        cfg = ServeConfig(app=app, command=command, engine_port=port, listen=listen, env=env, group=group,
                          tenant=tenant, orchestrator=orchestrator, agent=agent or "",
                          mode=ParkMode(mode) if mode else None, footprint_bytes=footprint, idle_release_s=idle_release,
                          ready_timeout_s=ready_timeout, check_version=check,
                          client_factory=None if client_factory is None or not backups else
                          (lambda url, timeout: client_factory(backup, url, timeout)))
        try:
            served = serve_app(cfg)
        except RotaError as exc:
            raise click.ClickException(str(exc)) from None
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        click.echo(f"rota {app} serving at {served.url} (engine {served.client.base_url}, tenant "
                   f"{served.gpu.tenant}, group {served.gpu.group})", err=True)
        try:
            rc = served.wait(stop)
        finally:
            served.close()
        if rc:
            raise click.ClickException(f"the {app} engine exited with code {rc}")

    if backups:
        names = list(backups)
        serve = click.option("--backup", type=click.Choice(names), default=names[0], show_default=True,
                             help="Who keeps the weights over an offload park: "
                                  + "; ".join(f"{k}: {v}" for k, v in backups.items()) + ".")(serve)
    serve.help = (f"Serve {app} behind rota: the engine sleeps between turns and requests wait for its turn.\n\n"
                  f"{engine_help}")
    return serve


__all__ = ["make_serve"]
