"""rota plugin of rota-adapter-vllm: ``rota vllm serve``; a version check when loaded.

Registered under the ``rota`` entry-point group. Loading it never imports vLLM: an
installed vLLM outside :data:`rota_vllm._compat.VLLM_SPEC` is reported once in the
log with the ``pip install`` that fixes it; ``track`` and ``serve`` refuse it.
"""

from __future__ import annotations

import click

from rota import hookimpl
from rota_serving import make_serve
from rota_vllm._compat import check_server, warn_on_load
from rota_vllm._server import BACKUPS, ENGINE_ENV, engine_command, server_client

warn_on_load()


@click.group()
def vllm() -> None:
    """vLLM engines that take turns on a GPU (sleep/wake through rota)."""


def _check_and_prepare(client: object) -> None:
    """The served vLLM's version; then, with --backup rota, rota's pool reserved in its workers."""
    check_server(client)
    prepare = getattr(client, "prepare", None)
    if prepare is not None:
        prepare()


vllm.add_command(make_serve(
    "vllm", engine_command, ENGINE_ENV, _check_and_prepare,
    "Everything after `--` goes to `python -m vllm.entrypoints.openai.api_server` (with --enable-sleep-mode, "
    "VLLM_SERVER_DEV_MODE=1 and, with --backup rota, rota's --worker-extension-cls added), e.g.\n\n"
    "  rota vllm serve --listen 0.0.0.0:8000 -- Qwen/Qwen3-0.6B --dtype bfloat16",
    backups=BACKUPS, client_factory=server_client))


@hookimpl
def rota_cli(cli: click.Group) -> None:
    cli.add_command(vllm)
