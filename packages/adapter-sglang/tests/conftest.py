"""Fixtures of rota-adapter-sglang's tests: a real orchestrator on loopback (fake engines: rota_serving.testing)."""

from rota_serving.testing.fixtures import connect, endpoint  # noqa: F401
