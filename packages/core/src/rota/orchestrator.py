"""The orchestrator, for plugins that run or extend it: its engine, config, group state and services.

An orchestrator plugin (e.g. rota_etcd's replicas) builds an :class:`Orchestrator` over its
own :class:`GroupStore`, serves it with :func:`running_orchestrator` or the gRPC services
below, and reads the health names it must keep true.
"""

from __future__ import annotations

from rota._engine import GroupStore, MemoryStore, Orchestrator, OrchestratorConfig, Session
from rota._inproc import running_orchestrator
from rota._service import LEADER_HEALTH, SERVICE_NAMES
from rota._state import GroupState

__all__ = ["LEADER_HEALTH", "SERVICE_NAMES", "GroupState", "GroupStore", "MemoryStore", "Orchestrator",
           "OrchestratorConfig", "Session", "running_orchestrator"]
