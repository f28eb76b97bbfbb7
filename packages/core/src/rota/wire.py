"""The gRPC messages and stubs rota speaks, generated from its .proto files.

``rota_v1_pb2``/``rota_v1_pb2_grpc``: the tenant and admin API (``rota.v1``);
``snapshot_agent_pb2``/``snapshot_agent_pb2_grpc``: orchestrator <-> node agent;
``timeslice_orchestrator_pb2``/``..._grpc``: the peer-compatible v1alpha1 API.
Plugins import them from here, never from the generated package.
"""

from __future__ import annotations

from rota._generated import (
    rota_v1_pb2,
    rota_v1_pb2_grpc,
    snapshot_agent_pb2,
    snapshot_agent_pb2_grpc,
    timeslice_orchestrator_pb2,
    timeslice_orchestrator_pb2_grpc,
)

__all__ = ["rota_v1_pb2", "rota_v1_pb2_grpc", "snapshot_agent_pb2", "snapshot_agent_pb2_grpc",
           "timeslice_orchestrator_pb2", "timeslice_orchestrator_pb2_grpc"]
