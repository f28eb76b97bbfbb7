"""Click option types shared by rota's commands and plugins' commands (public: plugins import it).

:class:`Endpoint` (an orchestrator or agent address, named in its error by the flag or env var it
came from), :class:`ByteSize` (80GiB, 500MB), :class:`Seconds` (finite, >= 0) and
:func:`resident_first_option` (the ``--resident-first`` policy switch).
"""

from __future__ import annotations

import math
from typing import Any

import click

from rota._units import parse_bytes
from rota.config import check_endpoint
from rota.errors import RotaError

__all__ = ["ByteSize", "Endpoint", "Seconds", "resident_first_option"]


class Endpoint(click.ParamType):
    """``host:port`` or ``unix:PATH`` (comma-separated replicas allowed)."""

    name = "HOST:PORT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        source = "endpoint"
        if param is not None:  # name what the user typed or set: the flag, or the env var it came from
            source = param.opts[0] if param.opts else param.name or source
            if ctx is not None and ctx.get_parameter_source(param.name or "") == click.core.ParameterSource.ENVIRONMENT:
                source = getattr(param, "envvar", None) or source
        try:
            return check_endpoint(str(value), source)
        except RotaError as exc:
            self.fail(str(exc), param, ctx)


class Seconds(click.FloatRange):
    """A finite number of seconds, >= 0 (``positive``: > 0); NaN and infinity are refused naming the flag."""

    name = "SECONDS"

    def __init__(self, *, positive: bool = False) -> None:
        super().__init__(min=0, min_open=positive)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


class ByteSize(click.ParamType):
    """A size such as 80GiB, 500MB or 1000000."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value, what=param.opts[0] if param is not None and param.opts else "size")
        except RotaError as exc:
            self.fail(str(exc), param, ctx)


def resident_first_option(**extra: Any) -> Any:
    """``--resident-first SECONDS``, the same for ``rota orchestrator serve`` and ``rota demo``."""
    return click.option(
        "--resident-first", type=click.FloatRange(min=0), default=0.0, show_default=True,
        help="With --capacity: serve jobs whose state is on the device (or fits beside it) before parked ones, "
        "and let a parked job in after this many seconds, once the device is free, or once the residents have "
        "left it idle for what letting it in would cost: jobs that do not fit together then wait for room "
        "instead of trading places at every turn. 0 = off.", **extra)
