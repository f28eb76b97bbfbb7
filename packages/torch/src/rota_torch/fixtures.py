"""pytest fixtures for the tests of trainer adapters (needs pytest): ``connect`` untracks, before
closing, every model a test tracked on its tenants. A ``conftest.py`` imports what it uses::

    from rota.fixtures import endpoint  # noqa: F401
    from rota_torch.fixtures import connect  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import rota
from rota.testing import tenants
from rota_torch.testing import untrack_models_of

__all__ = ["connect"]


@pytest.fixture
def connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on the test orchestrator; untracked and closed after the test."""
    with tenants(endpoint, before_close=untrack_models_of) as connect:
        yield connect
