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


def engine_command(sglang_args: Sequence[str], engine_port: int, python: str | None = None, *,
                   sleep_mode: bool = True) -> list[str]:
    """The engine's command line: a leading positional model becomes ``--model-path``;
    ``--enable-memory-saver`` is added unless ``sleep_mode`` is False; host/port are rota's."""
    args = list(sglang_args)
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
    return [python or sys.executable, "-m", ENGINE_MODULE, *args, "--host", "127.0.0.1", "--port", str(engine_port)]


class SglangServer(EndpointClient):
    """A served SGLang engine: release/resume (inherited ``sleep``/``wake``) plus weight sync.

    Weight sync after a trainer step: call through rota's proxy URL (the call waits
    for the engine's turn) ``update_weights_from_disk(path)`` with the checkpoint the
    trainer wrote, then ``flush_cache()``.
    """

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        super().__init__(SGLANG, base_url, timeout_s)

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


__all__ = ["ENGINE_ENV", "ENGINE_MODULE", "SglangServer", "engine_command"]
