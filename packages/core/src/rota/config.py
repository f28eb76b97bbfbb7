"""Checking what users and callers hand rota: ids, sizes, endpoints and env vars.

One checker of each kind, for core and every plugin: an error names the bad value and
where it came from, and says what to write instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from rota._ids import check_id, check_pair, shown
from rota._units import env_bytes, format_bytes, parse_bytes
from rota.errors import ConfigError

_N = TypeVar("_N", int, float)

__all__ = ["MAX_PRIORITY", "MIN_PRIORITY", "check_endpoint", "check_id", "check_pair", "env_bytes", "env_float",
           "env_int", "format_bytes", "parse_bytes", "shown"]

# The priorities an orchestrator accepts (an acquire outside them is INVALID_ARGUMENT); schedulers check
# them at submit with these values (rota_slurm compiles them into its SPANK plugin).
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000


def check_endpoint(value: str, source: str) -> str:
    """Validate an orchestrator address given by ``source`` (a flag or env var name)."""
    for part in value.split(","):
        part = part.strip()
        if part.startswith("unix:") and len(part) > 5:
            continue
        host, _, port = part.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            continue
        raise ConfigError(f"{source}={value!r}: {part!r} is not host:port or unix:PATH "
                          "(e.g. 127.0.0.1:50051)")
    return value


def env_int(name: str, default: int, *, minimum: int) -> int:
    """An integer >= ``minimum`` from env var ``name`` (``default`` when unset), or a ConfigError naming it."""
    return _env_number(name, default, int, f"an integer >= {minimum}", lambda v: v >= minimum, f"is below {minimum}")


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """A number from env var ``name`` (``default`` when unset): > 0, or >= ``minimum`` when given."""
    if minimum is None:
        return _env_number(name, default, float, "a positive number", lambda v: v > 0, "must be > 0")
    return _env_number(name, default, float, f"a number >= {minimum:g}", lambda v: v >= minimum,
                       f"is below {minimum:g}")


def _env_number(name: str, default: _N, parse: Callable[[str], _N], want: str, ok: Callable[[_N], bool],
                why: str) -> _N:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        kind = "an integer" if parse is int else "a number"
        raise ConfigError(f"{name}={raw!r} is not {kind}; set it to {want} or unset it") from None
    if not ok(value):
        raise ConfigError(f"{name}={raw!r} {why}; set it to {want} or unset it")
    return value
