"""An orchestrator served on its own event-loop thread inside this process.

Used by `rota demo` (which drives its tenants from one process) and, through
:mod:`rota.testing`, by tests of rota and of plugins.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

from rota._engine import Orchestrator, OrchestratorConfig
from rota._service import serve


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_orchestrator(config: OrchestratorConfig | None = None, *, listen: str | None = None,
                         store: object | None = None) -> Iterator[tuple[str, Orchestrator]]:
    """Serve an orchestrator on its own event-loop thread; yield (endpoint, engine)."""
    listen = listen or f"127.0.0.1:{free_port()}"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    async def main() -> None:
        engine = Orchestrator(config or OrchestratorConfig(), store)  # type: ignore[arg-type]
        server = await serve(engine, listen)
        holder.update(engine=engine, server=server)
        ready.set()
        await engine.stopped.wait()
        await engine.stop()
        await server.stop(grace=0.5)
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surface start-up failures to the caller
            holder["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="rota-test-orchestrator", daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in holder:
        raise holder["error"]  # type: ignore[misc]
    engine = holder["engine"]
    try:
        yield listen, engine  # type: ignore[misc]
    finally:
        loop.call_soon_threadsafe(engine.stopped.set)  # type: ignore[attr-defined]
        thread.join(10)
