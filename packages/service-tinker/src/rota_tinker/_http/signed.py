"""Signed download URLs of this service: external weights (:mod:`rota_tinker._http.external`) and session traces
(:mod:`rota_tinker._http.trace`).

A URL carries ``expires=T&sig=S``: S an HMAC-SHA256, keyed by a secret of this service process (URLs die with
it), over the fields that name what it serves and T. It is its own credential (no API key needed, as with any
signed URL); an API key sent with it must be the owner's. The scheme follows the listener: https with
``--tls-cert``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from typing import Any
from urllib.parse import parse_qs

from rota_tinker._http.formats import BadRequest
from rota_tinker._http.server import Request

URL_TTL_S = 3600  # how long a signed download URL stays valid
_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?")


def sign(key: bytes, *fields: str | int) -> str:
    """The HMAC of ``fields`` (one per line) under ``key``."""
    return hmac.new(key, "\n".join(str(f) for f in fields).encode(), hashlib.sha256).hexdigest()


def expiry() -> int:
    """When a URL signed now stops being valid (Unix seconds)."""
    return int(time.time()) + URL_TTL_S


def make_url(req: Request, config: Any, key: bytes, expires: int, path: str, *fields: str) -> str:
    """A URL for ``path`` on the host the caller reached, signed over ``fields`` and ``expires``."""
    host = req.header("host")
    if not _HOST.fullmatch(host):
        raise BadRequest("the Host header is not a host[:port]; send the one you reach this service at")
    scheme = "https" if config.tls_cert else "http"
    return f"{scheme}://{host}{path}?expires={expires}&sig={sign(key, *fields, expires)}"


def expiry_and_signature(req: Request, hint: str) -> tuple[int, str]:
    """``expires`` and ``sig`` of a signed URL's query; 403 naming ``hint`` (what gives valid URLs) otherwise."""
    try:
        args = parse_qs(req.query, max_num_fields=4, strict_parsing=True)
        return int(args["expires"][0]), args["sig"][0]
    except (KeyError, ValueError):
        raise BadRequest(f"this URL lacks a valid expires/sig; use the {hint} gave", status=403) from None


def signed(key: bytes, expires: int, sig: str, *fields: str) -> bool:
    """Whether ``sig`` signs ``fields`` with ``expires``, which has not passed."""
    return expires >= time.time() and hmac.compare_digest(sig, sign(key, *fields, expires))


def check_caller(req: Request, config: Any, owner: str, refusal: str) -> None:
    """An API key sent with a signed URL must be ``owner``'s: 403 ``refusal`` otherwise."""
    key = req.headers.get("x-api-key")
    if key is not None:
        caller = config.tenant_for_key(key)
        if caller is None or caller.name != owner:
            raise BadRequest(refusal, status=403)
