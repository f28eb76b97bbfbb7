"""Serving an :class:`~rota_agent._agent.Agent`: gRPC server, health, Unix sockets, and an in-process runner.

``serve_agent`` adds SnapshotAgentService and ``grpc.health.v1.Health`` (overall and
per-service status SERVING; NOT_SERVING while shutting down), as the Kubernetes
DaemonSet of rota-scheduler-k8s probes it. With a socket directory it also serves
both on ``<dir>/agent.sock`` and opens the pid door ``<dir>/pid.sock``
(:mod:`rota_agent._door`), through which tenants prove which process they are.

The socket directory is checked, never trusted: it must be a real directory owned by
the agent's uid that nobody else may write to (created 0755 when missing), and an
``agent.lock`` in it (``flock``) keeps a second agent out. With tokens checked (or
``--insecure``) its sockets are 0666: any local process may connect, since what a caller
may do depends on its token and, for pids, on the kernel's word (SO_PEERCRED), not on
reaching the socket. Without (``private``) they are 0600: the agent serves its owner only.
``running_agent`` serves one on its own event-loop thread for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from rota.auth import ServerAuth
from rota.errors import ConfigError
from rota.rpc import bind, free_port, health_servicer, serve_in_thread
from rota.wire import snapshot_agent_pb2 as pb
from rota.wire import snapshot_agent_pb2_grpc as pb_grpc
from rota_agent._agent import Agent, AgentService
from rota_agent_client.door import DOOR_NAME

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SnapshotAgentService"].full_name
SOCKET_NAME, LOCK_NAME = "agent.sock", "agent.lock"


def default_socket_dir() -> str:
    """``/run/rota-agent`` for root, else ``$XDG_RUNTIME_DIR/rota-agent``, else ``/tmp/rota-agent-<uid>``."""
    if os.geteuid() == 0:
        return "/run/rota-agent"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return f"{xdg}/rota-agent" if xdg else f"/tmp/rota-agent-{os.getuid()}"


def agent_names(listen: str, socket_dir: str, names: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The addresses this agent answers to: an orchestrator's ``rota-agent`` token must name one of them (the
    address it dials, ``--agent``), so one replayed at another agent of the same key is refused there.

    ``names`` (``--name``, e.g. ``node1:9001`` when the orchestrator dials the agent by host name), the
    ``--listen`` address (a loopback one also as ``localhost:PORT``), ``unix:<socket_dir>/agent.sock``; a
    wildcard ``--listen`` (``0.0.0.0:PORT``, ``[::]:PORT``) answers to this host's names and addresses on that
    port too.
    """
    out = list(names)
    if listen:
        out.append(listen)
        host, _, port = listen.rpartition(":")
        if host.strip("[]") in ("127.0.0.1", "::1") and not listen.startswith("unix:"):
            out.append(f"localhost:{port}")
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            import socket

            hosts = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "[::1]"}
            with contextlib.suppress(OSError):
                for info in socket.getaddrinfo(socket.gethostname(), None):
                    ip = str(info[4][0])
                    hosts.add(f"[{ip}]" if ":" in ip else ip)
            out += [f"{h}:{port}" for h in sorted(hosts) if h]
    if socket_dir:
        out.append(f"unix:{os.path.join(socket_dir, SOCKET_NAME)}")
    return tuple(dict.fromkeys(out))


def claim_socket_dir(path: str) -> int:
    """Check (or create) the socket directory, lock it for this agent and clear stale sockets; the lock's fd."""
    if not os.path.lexists(path):
        try:
            os.mkdir(path, 0o755)  # a directory made meanwhile by someone else fails here, and is checked below
        except OSError as exc:
            raise ConfigError(f"cannot create the agent's socket directory {path!r}: {exc.strerror}; give "
                              "--socket-dir a directory of this user") from None
        os.chmod(path, 0o755)  # whatever the umask: tenants of other uids must reach the sockets
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(f"the agent's socket directory {path!r} must be a directory (not a link) owned by uid "
                          f"{os.geteuid()} that only it may write to; it is uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}: remove it or give another --socket-dir")
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(f"another rota agent serves in {path!r}; give each agent its own --socket-dir") from None
    for name in (SOCKET_NAME, DOOR_NAME):
        sock = os.path.join(path, name)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(sock).st_mode):
                os.close(fd)
                raise ConfigError(f"{sock!r} is in the way and is no socket; remove it")
            os.unlink(sock)  # left by an agent that is gone (we hold the lock)
    return fd


@dataclass
class Served:
    """What ``serve_agent`` started, for ``shutdown``."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    door: asyncio.AbstractServer | None = None
    lock_fd: int = -1
    socket_dir: str = ""


async def serve_agent(agent: Agent, listen: str, *, auth: ServerAuth | None = None,
                      socket_dir: str | None = None, tls: grpc.ServerCredentials | None = None,
                      private: bool = False) -> Served:
    """Start serving ``agent`` on ``listen`` (HOST:PORT or unix:PATH; "" = none), and on ``socket_dir`` when given.

    ``auth``: who callers are (default: nobody is checked, every caller is admin); ``tls``: TLS of ``listen``;
    ``private``: its Unix sockets are 0600 (only its owner and root reach them), else 0666.
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(AgentService(agent, auth), server)
    hs = await health_servicer((SERVICE_NAME,))
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if listen:
        bind(server, listen, None if listen.startswith("unix:") else tls)
    served = Served(server, hs)
    if socket_dir:
        served.lock_fd, served.socket_dir = claim_socket_dir(socket_dir), socket_dir
        bind(server, f"unix:{os.path.join(socket_dir, SOCKET_NAME)}")
        served.door = await agent.door.serve(os.path.join(socket_dir, DOOR_NAME))
    await server.start()
    mode = 0o600 if private else 0o666
    for name in (SOCKET_NAME, DOOR_NAME) if socket_dir else ():
        os.chmod(os.path.join(socket_dir, name), mode)
    if listen.startswith("unix:") and private:
        os.chmod(listen.removeprefix("unix:"), mode)
    return served


async def shutdown(agent: Agent, served: Served, grace: float = 1.0) -> None:
    await served.health.enter_graceful_shutdown()
    await agent.stop()
    await served.server.stop(grace)
    if served.door is not None:
        served.door.close()
        await served.door.wait_closed()
    if served.lock_fd >= 0:
        for name in (SOCKET_NAME, DOOR_NAME):  # still ours: the lock is held until here
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(served.socket_dir, name))
        os.close(served.lock_fd)


@contextlib.contextmanager
def running_agent(agent: Agent | None = None, *, listen: str | None = None, auth: ServerAuth | None = None,
                  socket_dir: str | None = None) -> Iterator[tuple[str, Agent]]:
    """Serve an agent on its own event-loop thread; yield (endpoint, agent).

    Call the agent's methods only through its loop (``agent_call``); RPCs are fine.
    """
    listen = listen or f"127.0.0.1:{free_port()}"
    agent = agent or Agent()

    async def start() -> tuple[Agent, object]:
        served = await serve_agent(agent, listen, auth=auth, socket_dir=socket_dir)
        agent._loop = asyncio.get_running_loop()  # type: ignore[attr-defined]

        async def stop() -> None:
            await shutdown(agent, served, 0.5)

        return agent, stop

    with serve_in_thread(start, name="rota-agent"):
        yield listen, agent
