"""Fixtures of rota-adapter-megatron's tests: a real orchestrator on loopback, tenants, cleanup.

Every test here needs megatron-core (the adapter's own dependency, installed by
``./dev setup``); a missing one skips with the pip line that fixes it.
"""

from __future__ import annotations

import pytest
import torch

from rota.fixtures import endpoint  # noqa: F401
from rota_torch.fixtures import connect  # noqa: F401

torch.set_num_threads(1)

try:
    import rota_megatron  # noqa: F401  (checks the megatron-core version)
except ImportError as exc:  # MegatronVersionError included
    pytest.skip(f"rota_megatron cannot load: {exc}", allow_module_level=True)
