"""What verl versions rota_verl targets: the range of its ``verl`` extra in ``pyproject.toml``, read back from the
installed metadata (written once), checked when verl loads the plugin.

The plugin subclasses verl's public classes (``PPOTrainerSync``, ``FSDPEngineWithLMHead``,
``FSDPEngineWithValueHead``) and registers them through verl's own registries (``register_trainer``,
``EngineRegistry.register``); the range is where those were read from verl's released wheel.
"""

from __future__ import annotations

import functools

from rota import compat
from rota.errors import UnsupportedVersion

DIST = "rota-adapter-verl"

__all__ = ["DIST", "UnsupportedVersion", "require_verl", "verl_spec"]


@functools.cache
def verl_spec() -> str:
    """The supported verl range, e.g. ``>=0.9.1,<0.10``."""
    return compat.declared(DIST, "verl")


def require_verl() -> str:
    """The installed verl version, checked against :func:`verl_spec`.

    :raises UnsupportedVersion: verl missing or outside the range; the message names the version and the fix.
    """
    return compat.require("verl", verl_spec(), f'pip install "verl{verl_spec()}"', needed_by=DIST)
