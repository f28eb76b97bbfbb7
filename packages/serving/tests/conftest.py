"""Fixtures of rota-serving's tests: a real orchestrator on loopback, fake engines on loopback."""

from rota_serving.testing.fixtures import connect, endpoint, fake_sglang, fake_vllm  # noqa: F401
