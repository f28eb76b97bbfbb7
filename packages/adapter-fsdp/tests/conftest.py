"""Fixtures of rota-adapter-fsdp's tests: a real orchestrator on loopback, tenants, cleanup."""

from __future__ import annotations

import torch

from rota.fixtures import endpoint  # noqa: F401
from rota_torch.fixtures import connect  # noqa: F401

torch.set_num_threads(1)
