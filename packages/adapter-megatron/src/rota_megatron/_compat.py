"""The megatron-core versions this adapter is known to work with, checked when it loads.

Who calls it: ``rota_megatron/__init__.py`` at import. The adapter touches Megatron
internals by name (DDP's ``buffers``/``expert_parallel_buffers`` with ``param_data``
and ``grad_data``, ``ChainedOptimizer.chained_optimizers``, a ``MegatronOptimizer``'s
inner ``optimizer``); those names move between Megatron releases, so an unverified
version is refused with the ``pip install`` line that fixes it instead of parking the
wrong tensors silently. Reads the installed distribution's metadata only: importing
``megatron.core`` itself is slow and prints warnings, and nothing here needs it.
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version  # a dependency of megatron-core

#: Inclusive lower and exclusive upper bound, as in pyproject.toml. Verified: 0.16.1.
SUPPORTED = ("0.16", "0.17")
PIP_FIX = f'pip install "megatron-core>={SUPPORTED[0]},<{SUPPORTED[1]}"'


class MegatronVersionError(ImportError):
    """megatron-core is missing or of a version this adapter was not verified with."""


def _key(version: str) -> Version:
    """Release numbers only: 0.16.0rc1 counts as 0.16.0 (a pre-release of a supported line)."""
    return Version(".".join(map(str, Version(version).release)))


def check_megatron(version: str | None = None) -> str:
    """Return the installed megatron-core version, or raise saying how to fix it.

    :param version: check this version string instead of the installed one (tests).
    :raises MegatronVersionError: not installed, or outside :data:`SUPPORTED`.
    """
    if version is None:
        try:
            version = metadata.version("megatron-core")
        except metadata.PackageNotFoundError:
            raise MegatronVersionError(f"rota-adapter-megatron needs megatron-core, which is not installed; "
                                       f"fix: {PIP_FIX}") from None
    if not _key(SUPPORTED[0]) <= _key(version) < _key(SUPPORTED[1]):
        raise MegatronVersionError(f"rota-adapter-megatron supports megatron-core >={SUPPORTED[0]},<{SUPPORTED[1]}"
                                   f" but {version} is installed; fix: {PIP_FIX}")
    return version
