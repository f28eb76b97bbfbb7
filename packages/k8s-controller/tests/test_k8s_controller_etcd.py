"""The controller against the HA orchestrator: real etcd, `rota orchestrator serve --etcd` in a process.

Kubernetes is still FakeKubeApi (a SMALL FAKE of the pod list/watch endpoints: no
API server can run here). Skipped where rota-orchestrator-etcd or the etcd binary
is missing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_tenant import Tenant

from rota.testing import eventually
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota_k8s_controller.controller import Controller, grpc_evictor
from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL
from rota_k8s_controller.testing import FakeKubeApi

etcd_testing = pytest.importorskip("rota_etcd.testing")
pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(not etcd_testing.etcd_available(), reason="needs the etcd binary")]


def group_status(endpoint: str, group: str) -> Any:
    with grpc.insecure_channel(endpoint) as ch:
        (g,) = pb_grpc.RotaServiceStub(ch).Status(pb.StatusRequest(group_id=group), timeout=10).groups
        return g


def test_deleted_pod_releases_its_turn_in_the_etcd_backed_orchestrator(
        tmp_path: Path, fake_api: FakeKubeApi, core_api: Any) -> None:
    with etcd_testing.EtcdCluster(tmp_path, size=1) as etcd, \
            etcd_testing.OrchestratorProcess(etcd.url, tmp_path / "orchestrator.log") as orch:
        endpoint = orch.endpoint
        ctl = Controller(core_api, grpc_evictor(endpoint), watch_timeout=2, retry_delay=0.2)
        thread = threading.Thread(target=ctl.run, daemon=True)
        thread.start()
        # rota's ids of pods in namespace "default": default.<label>
        a, b = Tenant(endpoint, "default.a", "default.grp0"), Tenant(endpoint, "default.b", "default.grp0")
        try:
            fake_api.create_pod("a-0", labels={JOB_LABEL: "a", GROUP_LABEL: "grp0"})
            fake_api.create_pod("b-0", labels={JOB_LABEL: "b", GROUP_LABEL: "grp0"})
            assert a.acquire_in_background().granted.wait(30), a.error
            b.acquire_in_background()
            eventually(lambda: list(group_status(endpoint, "default.grp0").queue) == ["default.b"], "b to queue")
            eventually(lambda: ctl.tracker.alive("default", "grp0", "a"), "the controller to see a")

            fake_api.delete_pod("a-0")

            assert b.granted.wait(30), f"{b.error}\n{orch.log_tail()}"
            assert group_status(endpoint, "default.grp0").holder == "default.b"
        finally:
            ctl.stop()
            thread.join(15)
            a.close()
            b.close()
