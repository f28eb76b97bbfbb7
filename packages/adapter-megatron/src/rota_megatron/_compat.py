"""The megatron-core versions this adapter is known to work with, checked when it loads.

Who calls it: ``rota_megatron/__init__.py`` at import. The adapter touches Megatron
internals by name (DDP's ``buffers``/``expert_parallel_buffers`` with ``param_data``
and ``grad_data``, ``ChainedOptimizer.chained_optimizers``, a ``MegatronOptimizer``'s
inner ``optimizer``); those names move between Megatron releases, so an unverified
version is refused with the ``pip install`` line that fixes it instead of parking the
wrong tensors silently. The check is :mod:`rota.compat`'s, which reads the installed
distribution's metadata only: importing ``megatron.core`` itself is slow and prints
warnings, and nothing here needs it.
"""

from __future__ import annotations

from rota.compat import check, declared, require
from rota.errors import UnsupportedVersion

#: The range in pyproject.toml's dependencies, read from the installed metadata. Verified: 0.16.1.
SPEC = declared("rota-adapter-megatron", "megatron-core")
#: Inclusive lower and exclusive upper bound of :data:`SPEC`.
SUPPORTED = tuple(part.lstrip("<>=") for part in SPEC.split(","))
PIP_FIX = f'pip install "megatron-core{SPEC}"'
ADAPTER = "rota-adapter-megatron"

#: megatron-core is missing or of a version this adapter was not verified with (an ImportError too).
MegatronVersionError = UnsupportedVersion


def check_megatron(version: str | None = None) -> str:
    """Return the installed megatron-core version, or raise saying how to fix it.

    A pre-release counts as its release (0.16.0rc1 is in a supported line).

    :param version: check this version string instead of the installed one (tests).
    :raises MegatronVersionError: not installed, or outside :data:`SUPPORTED`.
    """
    if version is None:
        return require("megatron-core", SPEC, PIP_FIX, needed_by=ADAPTER)
    return check("megatron-core", version, SPEC, PIP_FIX, where="given", needed_by=ADAPTER)
