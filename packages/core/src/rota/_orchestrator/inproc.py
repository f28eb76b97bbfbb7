"""An orchestrator served on its own event-loop thread inside this process.

Used by `rota demo` (which drives its tenants from one process) and, through
:mod:`rota.testing`, by tests of rota and of plugins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rota._orchestrator.config import OrchestratorConfig
from rota._orchestrator.grpc_server import free_port, serve_in_thread
from rota._orchestrator.service import serve
from rota._orchestrator.turns import Orchestrator
from rota.auth import ServerAuth

__all__ = ["free_port", "running_orchestrator"]


@contextlib.contextmanager
def running_orchestrator(config: OrchestratorConfig | None = None, *, listen: str | None = None,
                         store: object | None = None, auth: ServerAuth | None = None
                         ) -> Iterator[tuple[str, Orchestrator]]:
    """Serve an orchestrator on its own event-loop thread; yield (endpoint, orchestrator).

    ``auth``: who may call (:class:`rota.auth.ServerAuth`). Default: on a Unix socket its
    owner; on a loopback TCP port anyone (tests); give one with a key to check tokens.
    """
    listen = listen or f"127.0.0.1:{free_port()}"
    auth = auth or ServerAuth(local=listen.startswith("unix:"), insecure=not listen.startswith("unix:"))

    async def start() -> tuple[Orchestrator, object]:
        orchestrator = Orchestrator(config or OrchestratorConfig(), store)  # type: ignore[arg-type]
        server = await serve(orchestrator, listen, auth=auth)

        async def stop() -> None:
            await orchestrator.stop()
            await server.stop(grace=0.5)

        return orchestrator, stop

    with serve_in_thread(start, name="rota-orchestrator") as (orchestrator, _loop):
        yield listen, orchestrator
