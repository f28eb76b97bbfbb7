"""Checking what users and callers hand rota: ids, sizes, endpoints and env vars.

One checker of each kind, for core and every plugin: an error names the bad value and
where it came from, and says what to write instead.
"""

from __future__ import annotations

import os

from rota._ids import check_id, check_pair, shown
from rota._units import env_bytes, parse_bytes, percentile
from rota.errors import ConfigError

__all__ = ["check_endpoint", "check_id", "check_pair", "env_bytes", "env_float", "env_int", "parse_bytes",
           "percentile", "shown"]


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
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to an integer >= {minimum} or unset it") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is below {minimum}; set it to an integer >= {minimum} or unset it")
    return value


def env_float(name: str, default: float) -> float:
    """A number > 0 from env var ``name`` (``default`` when unset), or a ConfigError naming it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; set a positive number or unset it") from None
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} must be > 0; set a positive number or unset it")
    return value
