"""Validation of job and group ids, shared by the client, servers and CLI.

Ids travel in etcd keys, Slurm env vars and Kubernetes labels, so they are limited to
what all three accept: letters, digits, ``.``, ``_``, ``-``, ``:``; 1-128 characters,
starting with a letter or digit.
"""

from __future__ import annotations

import re

from rota.errors import InvalidArgument

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # matched whole (fullmatch): no trailing newline
_SHOWN = 48  # characters of a bad value quoted back in an error


def shown(value: object) -> str:
    """``repr`` of a caller's value for an error message, cut short: a 1 MiB id is not echoed back."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(str(value))} characters)"


def check_id(kind: str, value: str, *, job_id: str = "", group_id: str = "") -> str:
    """Return ``value`` if it is a valid id, else raise InvalidArgument naming it (cut short)."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{kind} is empty; give a non-empty {kind}")
    if not _ID.fullmatch(value):
        raise InvalidArgument(
            f"{kind} {shown(value)} is malformed: use 1-128 of letters, digits, '.', '_', '-', ':' starting with a "
            "letter or digit")
    return value


def check_pair(job_id: str, group_id: str) -> None:
    """Validate a job id and a group id together (the usual RPC pair)."""
    check_id("job_id", job_id, job_id=job_id, group_id=group_id)
    check_id("group_id", group_id, job_id=job_id, group_id=group_id)
