"""Version checks of the optional frameworks (vLLM, SGLang), with the ``pip install`` that fixes them.

Who calls it: :func:`rota_vllm.track` / ``rota vllm serve`` (and the same in
:mod:`rota_sglang`) before touching the framework, and each plugin module when it is
loaded (a mismatch is then logged once, not raised, so ``rota`` itself keeps working).
The one place that reads installed versions: nothing else imports ``importlib.metadata``.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Sequence

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from rota.errors import PermanentError

log = logging.getLogger(__name__)


class UnsupportedVersion(PermanentError):
    """The framework is missing, or its version is outside what this adapter targets.

    ``str()`` says which version was found and the exact ``pip install`` that fixes it;
    ``found`` is the version string (None when not installed), ``fix`` the command.
    """

    def __init__(self, message: str, *, found: str | None, fix: str) -> None:
        super().__init__(message)
        self.found, self.fix = found, fix


def installed(dists: Sequence[str]) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``dists`` that is installed, else None."""
    for d in dists:
        try:
            return d, importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_version(framework: str, found: str | None, spec: str, fix: str, *, dist: str | None = None,
                  where: str = "") -> str:
    """Raise :class:`UnsupportedVersion` unless ``found`` satisfies ``spec``; return ``found``.

    :param framework: import name shown to the user (``vllm``).
    :param found: the version seen (from metadata or a server's ``/version``), None if absent.
    :param spec: PEP 440 specifier the adapter targets (``>=0.10,<0.33``).
    :param fix: the ``pip install`` line that fixes a mismatch.
    :param where: what was asked (``installed``, ``server at http://…``), for the message.
    """
    adapter = f"rota-adapter-{framework}"
    if found is None:
        raise UnsupportedVersion(f"{framework} is not installed{where and ' ' + where}; {adapter} needs "
                                 f"{framework}{spec}. Fix: {fix}", found=None, fix=fix)
    local = found.split("+", 1)[0]
    try:
        ok = Version(local) in SpecifierSet(spec)
    except InvalidVersion:
        ok = False
    if not ok:
        name = dist or framework
        raise UnsupportedVersion(f"{name} {found}{where and ' (' + where + ')'} is not supported by {adapter}, "
                                 f"which targets {framework}{spec}. Fix: {fix}", found=found, fix=fix)
    return found


def warn_if_mismatched(framework: str, dists: Sequence[str], spec: str, fix: str) -> None:
    """Log (never raise) a mismatch of an installed framework; nothing when it is absent."""
    got = installed(dists)
    if got is None:
        return
    try:
        check_version(framework, got[1], spec, fix, dist=got[0], where="installed")
    except UnsupportedVersion as exc:
        log.warning("%s", exc)


__all__ = ["UnsupportedVersion", "check_version", "installed", "warn_if_mismatched"]
