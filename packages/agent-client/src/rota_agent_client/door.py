"""Client side of the agent's pid door: fetch a one-time ticket that proves this process's pid.

The agent (``rota agent serve``) reads the caller's pid, uid and gid from the kernel
(``SO_PEERCRED``) on ``<socket dir>/pid.sock`` and writes back one line of JSON
``{"ticket": ..., "pid": ...}``; the client sends the ticket as ``rota-proof`` metadata
when it opens its WorkloadChannel.
"""

from __future__ import annotations

import json
import os
import socket

__all__ = ["DOOR_NAME", "door_path", "fetch"]

DOOR_NAME = "pid.sock"
REPLY_MAX = 4096  # bytes a client reads from the door


def door_path(agent: str, proof: str | None = None) -> str:
    """The pid door to use for ``agent``: ``proof``, else ROTA_AGENT_PROOF, else beside a unix: agent socket."""
    if proof is None:
        proof = os.environ.get("ROTA_AGENT_PROOF")
    if proof is None and agent.startswith("unix:"):
        proof = os.path.join(os.path.dirname(agent[len("unix:"):]), DOOR_NAME)
    return proof or ""


def fetch(path: str, timeout: float = 5.0) -> str:
    """Ask the door at ``path`` for a ticket proving this process's pid (blocking)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        data = b""
        while len(data) < REPLY_MAX and not data.endswith(b"\n"):
            chunk = s.recv(REPLY_MAX - len(data))
            if not chunk:
                break
            data += chunk
    try:
        reply = json.loads(data)
    except ValueError:
        raise OSError(f"the pid door at {path} answered something that is not JSON") from None
    ticket = reply.get("ticket") if isinstance(reply, dict) else None
    if not isinstance(ticket, str):
        raise OSError(f"the pid door at {path} refused: {reply.get('error') if isinstance(reply, dict) else reply}")
    return ticket
