"""The pid door: a Unix socket that tells a process a one-time proof of its own pid.

gRPC does not show a server who is on the other end of a connection, and a pid a
client writes into metadata (``rota-pid``) proves nothing: any caller could name a
victim's pid. The kernel does know: ``SO_PEERCRED`` on a Unix socket gives the peer's
pid, uid and gid, translated into the agent's pid namespace. So a tenant first
connects to the door (``<socket dir>/pid.sock``); the agent reads the peer's
credentials, writes back one line of JSON ``{"ticket": ..., "pid": ...}`` and closes.
The tenant (:mod:`rota_agent_client.door`) sends the ticket as ``rota-proof`` metadata
when it opens its WorkloadChannel (over TCP or the agent's Unix socket); the agent
redeems it once, within ``TTL_S``, and from then on knows that channel's pid (and its
start time, so a reused pid is told apart).

A ticket is a random capability (``secrets``), not a signature: it is only ever handed
to the process it names, over a socket only that process holds. The door reads
nothing from its peer. Tickets are bounded per uid and in total, oldest dropped first.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import socket
import struct
import time
from dataclasses import dataclass

from rota import proc as _proc

log = logging.getLogger(__name__)

TTL_S = 60.0  # a ticket must be redeemed this soon
MAX_PER_UID = 32  # outstanding tickets of one uid (a flood only pushes out that uid's own)
MAX_TICKETS = 4096


@dataclass(frozen=True)
class Proof:
    """A process the kernel vouched for: pid (in the agent's namespace), uid, gid and start time."""

    pid: int
    uid: int
    gid: int
    start: int


class Door:
    """Issues and redeems pid proofs; lives on the agent's event loop."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._tickets: collections.OrderedDict[str, tuple[Proof, float]] = collections.OrderedDict()

    async def serve(self, path: str) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._handle, path=path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
            try:
                reply = {"ticket": self.issue(pid, uid, gid), "pid": pid}
            except LookupError as exc:
                reply = {"error": str(exc)}
            writer.write(json.dumps(reply).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), 5.0)
        except (OSError, asyncio.TimeoutError) as exc:
            log.info("pid door: a peer left early (%s)", type(exc).__name__)
        finally:
            writer.close()

    def issue(self, pid: int, uid: int, gid: int) -> str:
        """A ticket for the process ``pid`` (as SO_PEERCRED gave it)."""
        start = _proc.start_time(pid, self.proc_root) if pid > 0 else None
        if start is None:
            raise LookupError(f"the agent cannot see your process (pid {pid} in its namespace): run the agent in "
                              "the host PID namespace (Kubernetes: hostPID) so it can tell which process you are")
        self._expire()
        mine = [t for t, (p, _) in self._tickets.items() if p.uid == uid]
        for old in mine[:max(0, len(mine) - MAX_PER_UID + 1)]:
            del self._tickets[old]
        while len(self._tickets) >= MAX_TICKETS:
            self._tickets.popitem(last=False)
        ticket = secrets.token_urlsafe(32)
        self._tickets[ticket] = (Proof(pid, uid, gid, start), time.monotonic() + TTL_S)
        return ticket

    def redeem(self, ticket: str) -> Proof | None:
        """The proof behind ``ticket`` (used up), or None when it is unknown, expired or its process is gone."""
        self._expire()
        got = self._tickets.pop(ticket, None) if ticket else None
        if got is None:
            return None
        proof = got[0]
        return proof if _proc.alive(proof.pid, proof.start, self.proc_root) else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._tickets:
            ticket, (_, expires) = next(iter(self._tickets.items()))
            if expires > now:
                break
            del self._tickets[ticket]


__all__ = ["Door", "Proof"]
