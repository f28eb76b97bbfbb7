"""Offline validation of rendered objects against the official Kubernetes schemas.

No API server is needed: ``kubernetes-validate`` ships the OpenAPI-derived JSON
schemas of each Kubernetes release, and its *strict* mode also rejects unknown
fields (what ``kubectl apply`` would warn about or drop). ``rota k8s render`` and
``rota k8s tenant`` call :func:`validate_objects` before printing, and the tests use
it on every object. The oldest release checked is 1.34, the first with
``resource.k8s.io/v1`` (DRA generally available).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import kubernetes_validate
from kubernetes_validate import utils as _kv

from rota.errors import ConfigError

__all__ = ["MIN_VERSION", "ManifestError", "supported_versions", "validate_objects"]

log = logging.getLogger(__name__)
MIN_VERSION = "1.34"


class ManifestError(ConfigError):
    """A rendered object does not validate; ``problems`` lists ``(object, message)``."""

    def __init__(self, problems: list[tuple[str, str]], version: str) -> None:
        self.problems = problems
        self.version = version
        lines = "\n".join(f"  {obj}: {msg}" for obj, msg in problems)
        super().__init__(f"rendered objects are invalid for Kubernetes {version}:\n{lines}")


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2])


def supported_versions() -> list[str]:
    """Kubernetes minor versions (``1.34``, ``1.35``...) this installation can validate against."""
    found = {".".join(v.lstrip("v").split(".")[:2]) for v in _kv.all_versions()}
    return sorted((v for v in found if _key(v) >= _key(MIN_VERSION)), key=_key)


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    ns = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind', '?')} {ns}{meta.get('name', '?')}"


def validate_objects(objs: Sequence[dict[str, Any]], versions: Iterable[str] | None = None) -> list[str]:
    """Validate every object strictly against each version; return the versions checked.

    :param versions: minor versions such as ``["1.34"]``; default: all from 1.34 on.
    :raises ManifestError: listing each object that fails, with the schema's message.
    """
    checked = list(versions) if versions is not None else supported_versions()
    if not checked:
        raise ConfigError(f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for "
                          f"Kubernetes >= {MIN_VERSION}: pip install -U kubernetes-validate")
    for version in checked:
        problems: list[tuple[str, str]] = []
        for obj in objs:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                problems.append((_name(obj), f"{path or '(root)'}: {exc.message}"))
            except kubernetes_validate.SchemaNotFoundError:
                problems.append((_name(obj), f"Kubernetes {version} has no {obj.get('apiVersion')} "
                                 f"{obj.get('kind')} (rota needs {MIN_VERSION} or later)"))
            except _kv.VersionNotSupportedError:
                raise ConfigError(f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for "
                                  f"Kubernetes {version}; choose one of {', '.join(supported_versions())}") from None
        if problems:
            raise ManifestError(problems, version)
        log.debug("%d objects valid for Kubernetes %s", len(objs), version)
    return checked
