"""`rota agent serve` as a real process: health on its port, `rota agent status`, bad flags, who may listen where."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rota.testing import free_port

ROTA = os.path.join(os.path.dirname(sys.executable), "rota")


def test_serve_health_and_status(child_env, socket_dir):
    port = free_port()
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    p = subprocess.Popen([ROTA, "agent", "serve", "--listen", f"127.0.0.1:{port}", "--socket-dir", socket_dir,
                          "--insecure"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            h = health_pb2_grpc.HealthStub(ch)
            status = h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        out = subprocess.run([ROTA, "agent", "status", "--agent", f"127.0.0.1:{port}", "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and '"jobs": []' in out.stdout
        assert sorted(os.listdir(socket_dir)) == ["agent.lock", "agent.sock", "pid.sock"]
    finally:
        p.terminate()
        p.wait(20)
    assert p.returncode == 0
    assert os.listdir(socket_dir) == ["agent.lock"]  # its sockets are gone with it


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


def test_open_listener_needs_a_key_or_insecure(child_env, socket_dir, tmp_path):
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    port = free_port()
    out = subprocess.run([ROTA, "agent", "serve", "--listen", f"0.0.0.0:{port}", "--socket-dir", socket_dir],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--auth-key" in out.stderr and "--insecure" in out.stderr
    out = subprocess.run([ROTA, "agent", "serve", "--listen", f"127.0.0.1:{port}", "--socket-dir", socket_dir],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "only its Unix sockets" in out.stderr  # loopback TCP too: any local uid
    key = tmp_path / "key"
    subprocess.run([ROTA, "token", "keygen", str(key)], env=env, check=True, timeout=60)
    out = subprocess.run([ROTA, "agent", "serve", "--listen", f"0.0.0.0:{port}", "--auth-key", str(key),
                          "--insecure"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "contradict" in out.stderr
    key.chmod(0o644)
    out = subprocess.run([ROTA, "agent", "serve", "--auth-key", str(key)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "chmod 600" in out.stderr
    p = subprocess.Popen([ROTA, "agent", "serve", "--listen", f"0.0.0.0:{port}", "--insecure", "--socket-dir",
                          socket_dir], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert "WARNING: --insecure" in p.stderr.readline()
    finally:
        p.terminate()
        p.wait(20)


def test_socket_dir_of_another_agent_or_user_is_refused(child_env, socket_dir):
    env = dict(child_env, ROTA_LOAD_PLUGINS="rota-agent")
    first = subprocess.Popen([ROTA, "agent", "serve", "--socket-dir", socket_dir], env=env, stderr=subprocess.PIPE,
                             text=True)
    try:
        while "serving" not in first.stderr.readline():
            assert first.poll() is None
        out = subprocess.run([ROTA, "agent", "serve", "--socket-dir", socket_dir], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode != 0 and "another rota agent" in out.stderr
    finally:
        first.terminate()
        first.wait(20)
    os.chmod(socket_dir, 0o777)  # others could replace its sockets
    out = subprocess.run([ROTA, "agent", "serve", "--socket-dir", socket_dir], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "mode 777" in out.stderr
