"""pytest fixture for the tests of trainer adapters: ``torch_connect``, rota's ``connect`` that untracks,
before closing, every model a test tracked on its tenants.

A pytest plugin (rota-torch's ``pytest11`` entry point), on :mod:`rota.fixtures`' ``endpoint``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import rota
from rota.testing import tenants
from rota_torch.testing import untrack_models_of

__all__ = ["torch_connect"]


@pytest.fixture
def torch_connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on the test orchestrator; untracked and closed after the test."""
    with tenants(endpoint, before_close=untrack_models_of) as connect:
        yield connect
