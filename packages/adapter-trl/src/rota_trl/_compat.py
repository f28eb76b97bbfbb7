"""What TRL versions rota_trl supports: the range in its ``pyproject.toml`` (a dependency), read back from the
installed metadata so it is written once, and checked when a job starts (``on_train_begin``).

The callback uses only transformers' public ``TrainerCallback`` events and, for the extra models a TRL trainer
keeps, public attributes (``ref_model``, ``teacher_model``, ``reward_funcs``, ``vllm_generation.llm``); the
range is where those were read from TRL's released wheels.
"""

from __future__ import annotations

import functools

from rota import compat
from rota.errors import UnsupportedVersion

DIST = "rota-adapter-trl"

__all__ = ["DIST", "UnsupportedVersion", "require_trl", "trl_spec", "warn_on_load"]


@functools.cache
def trl_spec() -> str:
    """The supported TRL range, e.g. ``>=1.10,<1.17`` (from rota-adapter-trl's installed metadata)."""
    return compat.declared(DIST, "trl")


def _fix() -> str:
    return f'pip install "trl{trl_spec()}"'


def require_trl() -> str:
    """The installed TRL version, checked against :func:`trl_spec`.

    :raises UnsupportedVersion: TRL missing or outside the range; the message names the version and the fix.
    """
    return compat.require("trl", trl_spec(), _fix(), needed_by=DIST)


def warn_on_load() -> str | None:
    """Log (never raise) an installed TRL outside the range: ``rota`` loads this plugin for every command."""
    return compat.warn_if_mismatched("trl", trl_spec(), _fix(), needed_by=DIST)
