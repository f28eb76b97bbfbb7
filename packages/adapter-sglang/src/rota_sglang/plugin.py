"""rota plugin of rota-adapter-sglang: ``rota sglang serve``; a version check when loaded.

Loading it never imports SGLang: an installed SGLang outside
:data:`rota_sglang._compat.SGLANG_SPEC` is reported once in the log with the fix.
"""

from __future__ import annotations

import click

from rota import hookimpl
from rota_serving import make_serve
from rota_sglang._compat import check_server, warn_on_load
from rota_sglang._server import BACKUPS, ENGINE_ENV, engine_command, server_client

warn_on_load()


@click.group()
def sglang() -> None:
    """SGLang engines that take turns on a GPU (release/resume memory occupation through rota)."""


sglang.add_command(make_serve(
    "sglang", engine_command, ENGINE_ENV, check_server,
    "Everything after `--` goes to `python -m sglang.launch_server` (with --enable-memory-saver and, with "
    "--backup sglang, --enable-weights-cpu-backup added), e.g.\n\n"
    "  rota sglang serve --listen 0.0.0.0:30000 -- Qwen/Qwen3-0.6B",
    backups=BACKUPS, client_factory=server_client))


@hookimpl
def rota_cli(cli: click.Group) -> None:
    cli.add_command(sglang)
