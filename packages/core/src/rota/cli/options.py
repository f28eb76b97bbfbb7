"""Click option types shared by rota's commands (and plugins' commands)."""

from __future__ import annotations

from typing import Any

import click

from rota._client import check_endpoint
from rota._units import parse_bytes
from rota.errors import RotaError


class Endpoint(click.ParamType):
    """``host:port`` or ``unix:PATH`` (comma-separated replicas allowed)."""

    name = "HOST:PORT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return check_endpoint(str(value), f"--{param.name if param else 'endpoint'}")
        except RotaError as exc:
            self.fail(str(exc), param, ctx)


class ByteSize(click.ParamType):
    """A size such as 80GiB, 500MB or 1000000."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value, what=f"--{param.name if param else 'size'}")
        except RotaError as exc:
            self.fail(str(exc), param, ctx)


def resident_first_option(**extra: Any) -> Any:
    """``--resident-first SECONDS``, the same for ``rota orchestrator serve`` and ``rota demo``."""
    return click.option(
        "--resident-first", type=click.FloatRange(min=0), default=0.0, show_default=True,
        help="With --capacity: serve jobs whose state is on the device (or fits beside it) before parked ones, "
        "and let a parked job in after this many seconds (or once the device is free): jobs that do not fit "
        "together then wait for room instead of trading places at every turn. 0 = off.", **extra)
