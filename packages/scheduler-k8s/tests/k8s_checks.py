"""Structural checks shared by the manifest tests (not a test module itself)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kubernetes import client

from rota._generated import rota_v1_pb2 as pb
from rota._generated import rota_v1_pb2_grpc as pb_grpc

_api = client.ApiClient()


def model_class(obj: dict[str, Any]) -> str:
    """Name of the official client's model class for this object."""
    if obj["apiVersion"] == "resource.k8s.io/v1" and obj["kind"] == "ResourceClaim":
        return "ResourceV1ResourceClaim"  # V1ResourceClaim is the pod-level reference
    return f"V1{obj['kind']}"


def roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    """Deserialize into the client's model class and serialize back: unknown fields are lost."""
    model = _api.deserialize(json.dumps(obj), model_class(obj), "application/json")
    return _api.sanitize_for_serialization(model)


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(object name, pod template metadata, pod spec) of every workload."""
    out = []
    for o in objs:
        if o["kind"] == "Pod":
            out.append((o["metadata"]["name"], o["metadata"], o["spec"]))
        elif o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = o["spec"]["template"]
            out.append((o["metadata"]["name"], t["metadata"], t["spec"]))
    return out


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout`` (a hang guard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


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
