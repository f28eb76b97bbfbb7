"""``rota tinker serve``: run the Tinker-compatible service in the foreground.

Flags fall back to environment variables: ``ROTA_TINKER_LISTEN``, ``ROTA_TINKER_KEYS``
(``TENANT=tml-KEY,...``), ``ROTA_TINKER_DEVICE``, ``ROTA_TINKER_DATA_DIR``,
``ROTA_ORCHESTRATOR`` (the rota orchestrator; unset: the embedded one), ``ROTA_GROUP``.
"""

from __future__ import annotations

import logging
import os
import tempfile

import click

from rota.errors import RotaError

log = logging.getLogger(__name__)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8000)", param_hint="--listen")
    return host, int(port)


@click.group()
def tinker() -> None:
    """A Tinker-API-compatible training service whose tenants take turns on GPUs."""


@tinker.command("serve")
@click.option("--listen", default="127.0.0.1:8000", show_default=True, envvar="ROTA_TINKER_LISTEN",
              help="HOST:PORT to serve HTTP on (env ROTA_TINKER_LISTEN).")
@click.option("--tenant", "tenants", multiple=True, envvar="ROTA_TINKER_KEYS",
              help="NAME=tml-KEY; repeat per tenant (env ROTA_TINKER_KEYS, comma-separated).")
@click.option("--device", default="cpu", show_default=True, envvar="ROTA_TINKER_DEVICE",
              help="Device of every worker: cpu, cuda or cuda:N (env ROTA_TINKER_DEVICE).")
@click.option("--group", default="tinker", show_default=True, envvar="ROTA_GROUP",
              help="rota group the workers share (env ROTA_GROUP).")
@click.option("--orchestrator", default=None, envvar="ROTA_ORCHESTRATOR",
              help="rota orchestrator HOST:PORT (env ROTA_ORCHESTRATOR; unset: the embedded one).")
@click.option("--data-dir", default=None, envvar="ROTA_TINKER_DATA_DIR",
              help="Where sampler weights are written (env ROTA_TINKER_DATA_DIR; default: a temp dir).")
@click.option("--long-poll", type=float, default=10.0, show_default=True,
              help="Seconds retrieve_future waits before answering try_again.")
def serve_cmd(listen: str, tenants: tuple[str, ...], device: str, group: str, orchestrator: str | None,
              data_dir: str | None, long_poll: float) -> None:
    """Serve the tinker SDK's training and sampling API; each API key is a tenant."""
    from rota_tinker._config import ServiceConfig, parse_keys
    from rota_tinker._service import TinkerService

    host, port = _listen(listen)
    try:
        parsed = [t for item in tenants for t in parse_keys(item)]
        config = ServiceConfig(tenants=tuple(parsed), data_dir=data_dir or tempfile.mkdtemp(prefix="rota-tinker-"),
                               device=device, group=group, endpoint=orchestrator or None, long_poll_s=long_poll)
    except RotaError as e:
        raise click.UsageError(str(e)) from e
    os.makedirs(config.data_dir, exist_ok=True)
    try:
        service = TinkerService(config, host, port)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {listen}: {e}") from e
    click.echo(f"rota tinker: serving {service.url} for tenants {[t.name for t in config.tenants]} "
               f"(TINKER_BASE_URL={service.url})", err=True)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
