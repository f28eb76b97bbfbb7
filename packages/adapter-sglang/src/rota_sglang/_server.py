"""Server mode of rota_sglang: the engine command line, and a client of a served engine.

The engine runs as ``python -m sglang.launch_server --enable-memory-saver`` on
127.0.0.1 and a port rota picks; rota's proxy (:mod:`rota_serving`, shared with the vLLM adapter)
serves clients, and the park hooks call ``POST /release_memory_occupation`` /
``POST /resume_memory_occupation`` with ``{"tags": [...]}``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rota.errors import InvalidArgument
from rota_serving import SGLANG, EndpointClient

ENGINE_MODULE = "sglang.launch_server"
ENGINE_ENV: dict[str, str] = {}
BACKUPS = {"sglang": "SGLang keeps them in host memory (--enable-weights-cpu-backup, added)",
           "none": "dropped at every park, as in RL where the trainer pushes fresh ones after each restore "
                   "(update_weights_from_disk)"}
BACKUP_FLAG = "--enable-weights-cpu-backup"


def engine_command(sglang_args: Sequence[str], engine_port: int, python: str | None = None, *,
                   sleep_mode: bool = True, backup: str = "sglang") -> list[str]:
    """The engine's command line: a leading positional model becomes ``--model-path``;
    ``--enable-memory-saver`` is added unless ``sleep_mode`` is False, and with ``backup="sglang"``
    ``--enable-weights-cpu-backup`` (without it a release drops the weights); host/port are rota's."""
    if backup not in BACKUPS:
        raise InvalidArgument(f"backup {backup!r} is not one of {', '.join(BACKUPS)}")
    args = list(sglang_args)
    if backup == "none" and BACKUP_FLAG in args:
        raise InvalidArgument(f"{BACKUP_FLAG} with --backup none: the engine would keep the weights that rota "
                              "reports dropped; leave the flag out, or serve with --backup sglang")
    for a in args:
        if a.split("=", 1)[0] in ("--host", "--port"):
            raise InvalidArgument(f"sglang argument {a!r}: rota owns the engine's address; give the public one as "
                                  "`rota sglang serve --listen HOST:PORT` instead")
    if args and not args[0].startswith("-"):
        args = ["--model-path", args[0], *args[1:]]
    if not any(a.split("=", 1)[0] in ("--model-path", "--model") for a in args):
        raise InvalidArgument("no model in the sglang arguments; e.g. `rota sglang serve -- Qwen/Qwen3-0.6B` or "
                              "`-- --model-path /path/to/model`")
    if sleep_mode and "--enable-memory-saver" not in args:
        args.append("--enable-memory-saver")
    if sleep_mode and backup == "sglang" and BACKUP_FLAG not in args:
        args.append(BACKUP_FLAG)
    return [python or sys.executable, "-m", ENGINE_MODULE, *args, "--host", "127.0.0.1", "--port", str(engine_port)]


class SglangServer(EndpointClient):
    """A served SGLang engine: release/resume (inherited ``sleep``/``wake``) plus weight sync.

    Weight sync after a trainer step: call through rota's proxy URL (the call waits
    for the engine's turn) ``update_weights_from_disk(path)`` with the checkpoint the
    trainer wrote, then ``flush_cache()``.
    """

    def __init__(self, base_url: str, timeout_s: float = 300.0, keeps_weights: bool = True) -> None:
        super().__init__(SGLANG, base_url, timeout_s, keeps_weights)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> Any:
        """``POST /update_weights_from_disk``; raises with the server's message when it says success=false."""
        if not model_path:
            raise InvalidArgument("update_weights_from_disk: model_path is empty; give the checkpoint folder")
        body: dict[str, Any] = {"model_path": model_path}
        if load_format:
            body["load_format"] = load_format
        got = self.call("POST", "/update_weights_from_disk", body)
        if isinstance(got, dict) and got.get("success") is False:
            raise InvalidArgument(f"{self.base_url} refused weights from {model_path!r}: {got.get('message')}")
        return got

    def flush_cache(self) -> None:
        """``POST /flush_cache``: forget cached prefixes computed with the old weights."""
        self.call("POST", "/flush_cache")


def server_client(backup: str, base_url: str, timeout_s: float) -> SglangServer:
    """The client ``rota sglang serve --backup BACKUP`` parks the engine with."""
    return SglangServer(base_url, timeout_s, keeps_weights=backup == "sglang")


__all__ = ["BACKUPS", "ENGINE_ENV", "ENGINE_MODULE", "SglangServer", "engine_command", "server_client"]
