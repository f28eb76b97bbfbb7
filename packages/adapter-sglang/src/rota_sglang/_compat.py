"""What SGLang versions rota_sglang targets, checked through :mod:`rota.compat`.

The installed version comes from the ``sglang`` distribution; a served engine's from
its ``GET /get_server_info`` (field ``version``).
"""

from __future__ import annotations

from rota.compat import require, warn_if_mismatched
from rota.errors import UnsupportedVersion
from rota_serving import EndpointClient, check_server_version

#: SGLang versions this adapter targets (release/resume_memory_occupation with tags).
SGLANG_SPEC = ">=0.4.6,<0.6"
DISTS = ("sglang",)
FIX = 'pip install "sglang>=0.4.6,<0.6"'
ADAPTER = "rota-adapter-sglang"


def require_sglang() -> str:
    """The installed SGLang version; raises :class:`UnsupportedVersion` (with the fix) otherwise."""
    return require(DISTS, SGLANG_SPEC, FIX, needed_by=ADAPTER)


def check_server(client: EndpointClient) -> str:
    """The version a running SGLang server reports at ``GET /get_server_info``, checked."""
    return check_server_version(client, "/get_server_info", SGLANG_SPEC, FIX, needed_by=ADAPTER)


def warn_on_load() -> None:
    """Log an installed SGLang outside :data:`SGLANG_SPEC` (the plugin module calls this when it loads)."""
    warn_if_mismatched(DISTS, SGLANG_SPEC, FIX, needed_by=ADAPTER)


__all__ = ["DISTS", "FIX", "SGLANG_SPEC", "UnsupportedVersion", "check_server", "require_sglang", "warn_on_load"]
