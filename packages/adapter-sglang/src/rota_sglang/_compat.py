"""What SGLang versions rota_sglang targets, and the checks against them.

The installed version comes from the ``sglang`` distribution; a served engine's from
its ``GET /get_server_info`` (field ``version``).
"""

from __future__ import annotations

from rota_vllm._versions import UnsupportedVersion, check_version, installed, warn_if_mismatched
from rota_vllm.serving import EndpointClient

#: SGLang versions this adapter targets (release/resume_memory_occupation with tags).
SGLANG_SPEC = ">=0.4.6,<0.6"
DISTS = ("sglang",)
FIX = 'pip install "sglang>=0.4.6,<0.6"'


def require_sglang() -> str:
    """The installed SGLang version; raises :class:`UnsupportedVersion` (with the fix) otherwise."""
    got = installed(DISTS)
    return check_version("sglang", got[1] if got else None, SGLANG_SPEC, FIX, where="installed")


def check_server(client: EndpointClient) -> str:
    """The version a running SGLang server reports at ``GET /get_server_info``, checked."""
    got = client.call("GET", "/get_server_info")
    found = got.get("version") if isinstance(got, dict) else None
    if not isinstance(found, str):
        raise UnsupportedVersion(f"{client.base_url}/get_server_info answered without a \"version\" string; is it "
                                 "an SGLang server?", found=None, fix=FIX)
    return check_version("sglang", found, SGLANG_SPEC, FIX, where=f"server at {client.base_url}")


def warn_on_load() -> None:
    warn_if_mismatched("sglang", DISTS, SGLANG_SPEC, FIX)


__all__ = ["DISTS", "FIX", "SGLANG_SPEC", "UnsupportedVersion", "check_server", "require_sglang", "warn_on_load"]
