"""Byte sizes and percentiles, as users write and read them (flags and env vars alike)."""

from __future__ import annotations

import os
import re

from rota.errors import ConfigError, InvalidArgument

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def parse_bytes(text: str, *, what: str = "size") -> int:
    """``"80GiB"`` -> 85899345920. Raises InvalidArgument naming ``what`` on bad input."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise InvalidArgument(f"{what} {text!r} is not a size; write e.g. 80GiB, 500MB or 1000000")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[idx])


def env_bytes(name: str, default: int) -> int:
    """A byte count from env var ``name`` in the units every rota size takes (``256MiB``, ``12GB``, ``1000000``)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().startswith("-"):
        raise ConfigError(f"{name}={raw!r} is negative; give a size >= 0 (e.g. 12GB) or unset it")
    try:
        return parse_bytes(raw.strip(), what=name)
    except InvalidArgument:
        raise ConfigError(f"{name}={raw!r} is not a size; write e.g. 256MiB, 12GB or 1000000, or unset it") from None
