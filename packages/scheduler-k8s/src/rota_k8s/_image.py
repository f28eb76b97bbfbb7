"""Container image references, checked against the OCI distribution reference grammar.

The grammar (github.com/distribution/reference, what container runtimes parse)::

    reference  := name [ ":" tag ] [ "@" digest ]
    name       := [ domain "/" ] path-component [ "/" path-component ]*
    domain     := host [ ":" port ]          host: DNS name, IPv4 or [IPv6]
    path-component := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
    tag        := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest     := algorithm ":" hex{32,}

A first component is a domain only when it holds a '.' or ':' or is ``localhost``, so
``busybox``, ``x`` and ``library/busybox`` are all valid short names (the runtime adds
``docker.io/library/`` and ``:latest``); ``Busybox`` is not (path components are lowercase).
"""

from __future__ import annotations

import re

from rota.compat import installed

__all__ = ["IMAGE_NAME", "default_image", "image_problem"]

IMAGE_NAME = "rota"

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])"
_DOMAIN = re.compile(rf"{_HOST}(?::[0-9]+)?")
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}")
MAX_NAME = 255


def image_problem(ref: object) -> str | None:
    """Why ``ref`` is not an OCI image reference (one phrase), or None when it is one."""
    if not isinstance(ref, str) or not ref:
        return "is empty: give an image such as registry.example/rota:0.1.0"
    rest, _, digest = ref.partition("@")
    if "@" in ref and not _DIGEST.fullmatch(digest):
        return f"has a bad digest {digest!r} (ALGORITHM:HEX, e.g. sha256: and 64 hex digits)"
    name, tag = rest, ""
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = rest[: len(rest) - len(last)] + last.split(":", 1)[0], last.split(":", 1)[1]
        if not _TAG.fullmatch(tag):
            return f"has a bad tag {tag!r} (letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-')"
    if len(name) > MAX_NAME:
        return f"has a name longer than {MAX_NAME} characters"
    parts = name.split("/")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost"):
        if not _DOMAIN.fullmatch(first):
            return f"has a bad registry {first!r} (HOST or HOST:PORT)"
        parts = parts[1:]
    for part in parts:
        if not _COMPONENT.fullmatch(part):
            return (f"has a bad path component {part!r}: lowercase letters and digits, separated by '.', '_', '__' "
                    "or dashes")
    return None


def default_image() -> str:
    """The tag ``rota k8s image`` builds the repository's Dockerfile as: ``rota:`` and this package's version."""
    found = installed("rota-scheduler-k8s")
    return f"{IMAGE_NAME}:{found[1] if found else '0.1.0'}"
