"""What ``/proc`` says about a process: its start time and its parent.

A pid alone is not an identity, since pids are reused; a pid with its start time
(field 22 of ``/proc/PID/stat``, clock ticks since boot) is: a process that exited and
whose pid went to another has a different start time. Used by the node agent (it acts
only on processes a registered job proved are its own) and by the node host ledger (an
entry counts only for the live process that wrote it).
"""

from __future__ import annotations

import os

MAX_DEPTH = 64  # parent links followed when asking whether a pid descends from another


def _stat(pid: int, proc_root: str) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid``, or None when it does not exist (or cannot be read)."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), encoding="ascii", errors="replace") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # after "PID (comm) ": the comm may hold spaces and parens
    try:
        return int(fields[1]), int(fields[19])  # ppid is field 4, starttime field 22 (1-based, counting pid, comm)
    except (IndexError, ValueError):
        return None


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """The start time of ``pid``, or None when no such process is visible."""
    got = _stat(pid, proc_root) if pid > 0 else None
    return got[1] if got else None


def alive(pid: int, start: int, proc_root: str = "/proc") -> bool:
    """True when ``pid`` is still the process that started at ``start``."""
    return start_time(pid, proc_root) == start


def uid(pid: int, proc_root: str = "/proc") -> int | None:
    """The effective uid of ``pid`` (``/proc/PID/status``: whose rights it acts with, a setuid program's
    owner's), or None when it cannot be read."""
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError):
        pass
    return None


def descends(pid: int, ancestors: set[int], proc_root: str = "/proc") -> bool:
    """True when ``pid`` is one of ``ancestors`` or a descendant of one (parent links, at most MAX_DEPTH)."""
    for _ in range(MAX_DEPTH):
        if pid in ancestors:
            return True
        got = _stat(pid, proc_root) if pid > 1 else None
        if got is None:
            return False
        pid = got[0]
    return False


__all__ = ["alive", "descends", "start_time", "uid"]
