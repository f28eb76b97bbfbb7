"""Helpers for tests of rota and of plugins: a real orchestrator on loopback.

Public on purpose: adapter packages use :func:`running_orchestrator` to test against
the embedded orchestrator over real gRPC, in a thread of the test process.
"""

from rota._inproc import free_port, running_orchestrator

__all__ = ["free_port", "running_orchestrator"]
