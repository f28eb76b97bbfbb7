"""What SGLang versions rota_sglang targets: the range in its ``pyproject.toml`` (extra ``sglang``),
checked through :class:`rota_serving.EngineVersions`.

The installed version comes from the ``sglang`` distribution; a served engine's from
its ``GET /get_server_info`` (field ``version``).
"""

from __future__ import annotations

from rota.errors import UnsupportedVersion
from rota_serving import EngineVersions

#: SGLang versions this adapter targets (release/resume_memory_occupation with tags).
VERSIONS = EngineVersions("rota-adapter-sglang", ("sglang",), "/get_server_info")
DISTS = VERSIONS.dists
__getattr__ = VERSIONS.module_getattr(__name__, "SGLANG_SPEC")  # SGLANG_SPEC, FIX: read on first use
require_sglang, check_server, warn_on_load = VERSIONS.require, VERSIONS.check_server, VERSIONS.warn_on_load

__all__ = ["DISTS", "VERSIONS", "UnsupportedVersion", "check_server", "require_sglang",
           "warn_on_load"]
