"""`rota agent serve` as a real process: health on its port, `rota agent status`, bad flags."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rota.testing import free_port

ROTA = os.path.join(os.path.dirname(sys.executable), "rota")


def test_serve_health_and_status(child_env):
    port = free_port()
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    p = subprocess.Popen([ROTA, "agent", "serve", "--listen", f"127.0.0.1:{port}"], env=env,
                         stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            h = health_pb2_grpc.HealthStub(ch)
            status = h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        out = subprocess.run([ROTA, "agent", "status", "--agent", f"127.0.0.1:{port}", "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and '"jobs": []' in out.stdout
    finally:
        p.terminate()
        p.wait(20)
    assert p.returncode == 0


def test_bad_flags_name_the_value(child_env):
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    out = subprocess.run([ROTA, "agent", "serve", "--listen", "nowhere"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "nowhere" in out.stderr
    out = subprocess.run([ROTA, "orchestrator", "serve", "--agent", "bad:port"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "bad:port" in out.stderr
    out = subprocess.run([ROTA, "agent", "serve", "--residue-max-bytes", "-1"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "-1" in out.stderr and "--residue-max-bytes" in out.stderr
    out = subprocess.run([ROTA, "agent", "serve"], env=dict(env, ROTA_RESIDUE_MAX_BYTES="lots"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "ROTA_RESIDUE_MAX_BYTES='lots'" in out.stderr
    started = time.monotonic()
    assert time.monotonic() >= started
