"""Tenant: a rota.v1 client over real gRPC, for the controller tests (not a test module itself)."""

from __future__ import annotations

import threading

import grpc

from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc


class Tenant:
    """A tenant talking to the orchestrator over real gRPC (rota.v1 Acquire, no session)."""

    def __init__(self, endpoint: str, job_id: str, group_id: str) -> None:
        self.job_id, self.group_id = job_id, group_id
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = pb_grpc.RotaServiceStub(self.channel)
        self.granted = threading.Event()
        self.error: grpc.RpcError | None = None
        self.grant: pb.Grant | None = None

    def acquire_in_background(self) -> Tenant:
        def run() -> None:
            try:
                self.grant = self.stub.Acquire(pb.TurnRequest(job_id=self.job_id, group_id=self.group_id),
                                               timeout=60)
                self.granted.set()
            except grpc.RpcError as exc:
                self.error = exc

        threading.Thread(target=run, daemon=True, name=f"tenant-{self.job_id}").start()
        return self

    def close(self) -> None:
        self.channel.close()
