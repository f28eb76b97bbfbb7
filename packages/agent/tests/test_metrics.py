"""`rota agent serve --metrics-listen`: a real Prometheus scrape of a real agent process, parsed with
prometheus_client's own text parser, after a real park and restore of a job registered over its socket."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import grpc
from agentlib import registered_here, run_op
from prometheus_client.parser import text_string_to_metric_families

from rota.testing import free_port
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc

ROTA = os.path.join(os.path.dirname(sys.executable), "rota")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``url``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_parks_restores_seconds_bytes_and_states_are_scraped(child_env, socket_dir) -> None:
    port, mport = free_port(), free_port()
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    p = subprocess.Popen([ROTA, "agent", "serve", "--listen", f"127.0.0.1:{port}", "--socket-dir", socket_dir,
                          "--metrics-listen", f"127.0.0.1:{mport}", "--insecure"], env=env, stderr=subprocess.PIPE,
                         text=True)
    url = f"http://127.0.0.1:{mport}/metrics"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            before = scrape(url)
            assert before[("rota_agent_jobs", (("state", "saved"),))] == 0
            stub = sa_grpc.SnapshotAgentServiceStub(ch)
            with registered_here(socket_dir, "j1", "g"):
                assert run_op(stub, "snapshot", "j1", "g").status == sa.OPERATION_STATUS_COMPLETE
                parked = scrape(url)
                assert run_op(stub, "restore", "j1", "g").status == sa.OPERATION_STATUS_COMPLETE
                after = scrape(url)
    finally:
        p.terminate()
        p.wait(20)

    park = (("backend", "app_channel"), ("operation", "park"))
    restore = (("backend", "app_channel"), ("operation", "restore"))
    assert parked[("rota_agent_jobs", (("state", "saved"),))] == 1
    assert parked[("rota_agent_residue_bytes", (("group", "g"), ("job", "j1")))] == 0  # its park left nothing
    assert after[("rota_agent_jobs", (("state", "saved"),))] == 0
    assert after[("rota_agent_jobs", (("state", "running"),))] == 1
    assert after[("rota_agent_operations_total", (*park, ("outcome", "ok")))] == 1
    assert after[("rota_agent_operations_total", (*restore, ("outcome", "ok")))] == 1
    assert after[("rota_agent_operation_seconds_count", park)] == 1  # a histogram in seconds
    assert after[("rota_agent_operation_seconds_bucket", tuple(sorted((*park, ("le", "+Inf")))))] == 1
    assert after[("rota_agent_operation_seconds_sum", park)] >= 0
    assert ("rota_agent_moved_bytes_total", park) in after


def test_bad_metrics_address_is_named(child_env) -> None:
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    out = subprocess.run([ROTA, "agent", "serve", "--metrics-listen", "9464"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "'9464' is not HOST:PORT" in out.stderr and "--metrics-listen" in out.stderr
