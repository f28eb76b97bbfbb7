"""rota-adapter-megatron's tests run torch on one thread (``endpoint``, ``torch_connect``: rota's and rota_torch's
pytest plugins).

Every test here needs megatron-core (the adapter's own dependency, installed by
``./dev setup``); a missing one skips with the pip line that fixes it.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

try:
    import rota_megatron  # noqa: F401  (checks the megatron-core version)
except ImportError as exc:  # MegatronVersionError included
    pytest.skip(f"rota_megatron cannot load: {exc}", allow_module_level=True)
