"""The node's host-memory ledger: pinned bytes of every rota process on this host.

A per-process budget cannot stop five tenants on one node from pinning 40 GB each on
a 128 GB host: the node swaps, then the OOM killer picks one. So every host pool also
records its process's in-memory bytes in a small file under one node-local directory
(``ROTA_NODE_LEDGER_DIR``, default ``/dev/shm/rota-host-ledger``), and a pool that
grows checks the sum of every *live* process's entry against the node budget
(``ROTA_NODE_HOST_BUDGET_BYTES``; 0 or unset = none). An ``flock`` on the directory's
lock file makes check-and-record atomic across processes; entries of processes that
died (pid gone, or reused: the start time differs) are dropped when read. No server
is needed, so ``rota-core`` alone enforces it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from rota.errors import ConfigError
from rota.tensors._guard import env_number

DEFAULT_DIR = "/dev/shm/rota-host-ledger"


def node_budget() -> int:
    """``ROTA_NODE_HOST_BUDGET_BYTES`` (0 = no node budget), validated."""
    return int(env_number("ROTA_NODE_HOST_BUDGET_BYTES", 0, integer=True))


def ledger_dir() -> str:
    """``ROTA_NODE_LEDGER_DIR`` (default under /dev/shm), created if missing; a clear error if unusable."""
    path = os.environ.get("ROTA_NODE_LEDGER_DIR") or DEFAULT_DIR
    try:
        os.makedirs(path, mode=0o1777, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"ROTA_NODE_LEDGER_DIR={path!r} cannot be created ({exc.strerror}); point it at a "
                          "writable node-local directory") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"ROTA_NODE_LEDGER_DIR={path!r} is not writable; point it at a writable node-local "
                          "directory shared by every rota process of this node")
    return path


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (/proc), so a reused pid is not mistaken for the old one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class NodeLedger:
    """The ledger while its lock is held: read other processes' bytes, record this one's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()

    def entries(self) -> dict[int, int]:
        """Bytes per live process (dead or reused pids are removed)."""
        out: dict[int, int] = {}
        for name in os.listdir(self.path):
            if not name.isdigit():
                continue
            file = os.path.join(self.path, name)
            try:
                with open(file) as f:
                    start, nbytes = f.read().split()
                pid = int(name)
                alive = _start_time(pid) == start
                value = int(nbytes)
            except (OSError, ValueError):
                continue
            if alive:
                out[pid] = value
            else:
                with contextlib.suppress(OSError):
                    os.unlink(file)
        return out

    def others(self) -> int:
        """In-memory host bytes of every other live rota process on this node."""
        return sum(n for pid, n in self.entries().items() if pid != self.pid)

    def record(self, nbytes: int) -> None:
        """This process now holds ``nbytes`` of host memory in pools (atomic replace)."""
        file = os.path.join(self.path, str(self.pid))
        tmp = f"{file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{_start_time(self.pid)} {nbytes}\n")
        os.replace(tmp, file)


@contextlib.contextmanager
def locked_ledger() -> Iterator[NodeLedger]:
    """The node ledger under its exclusive lock (held only for a check and a record, never an allocation)."""
    path = ledger_dir()
    with open(os.path.join(path, "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield NodeLedger(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def node_host_bytes() -> dict[int, int]:
    """Host bytes per live rota process on this node, from the ledger (for status and tests)."""
    with locked_ledger() as ledger:
        return ledger.entries()
