"""Issue 30, item 9 (low): names another group's refusal gave away, unbounded sessions, a key someone else owns.

The orchestrator checks tokens (``ServerAuth(key=...)``, as ``--auth-key`` does); the attacker holds a
valid token for its own job only. Each test shows the refusal and that the victim's state is unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

import rota
from rota import auth
from rota.orchestrator import OrchestratorConfig
from rota.testing import free_port, running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc

KEY = b"k" * 32


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def test_not_found_names_no_other_group():
    config = OrchestratorConfig(groups=("team-a-secret-project", "team-b-secret-project"))
    with running_orchestrator(config, auth=auth.ServerAuth(key=KEY)) as (endpoint, _):
        mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="nosuch", job="m")))
        code, details = _refused(lambda: mallory.Acquire(pb.TurnRequest(job_id="m", group_id="nosuch"), timeout=5))
        assert code == grpc.StatusCode.NOT_FOUND and "nosuch" in details
        assert "secret" not in details and "team-" not in details, details


def test_sessions_of_one_job_are_bounded_by_a_bounded_world_size():
    with running_orchestrator(OrchestratorConfig(ttl_s=3.0), auth=auth.ServerAuth(key=KEY)) as (endpoint, engine):
        victim = rota.connect(group="g", tenant="victim", endpoint=endpoint, token=auth.issue(KEY, group="g",
                                                                                              job="victim"))
        try:
            victim.acquire()
            mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="g", job="m")))
            for world_size in (1025, 10**6, 2**31 - 1):
                def hello(ws: int = world_size):
                    yield pb.TenantMessage(hello=pb.Hello(job_id="m", group_id="g", rank=ws - 1, world_size=ws,
                                                          pid=os.getpid()))
                code, details = _refused(lambda h=hello: list(mallory.Attach(h(), timeout=5)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "<= 1024" in details, details
                code, _ = _refused(lambda ws=world_size: mallory.Acquire(
                    pb.TurnRequest(job_id="m", group_id="g", rank=0, world_size=ws), timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert engine._live_sessions(("g", "m")) == []
            assert engine.groups["g"].holder == "victim"
        finally:
            victim.close()


def test_a_key_file_another_user_owns_is_refused(tmp_path, attacker_uid):
    key_file = tmp_path / "auth.key"
    auth.generate_key(str(key_file))
    os.chown(key_file, *attacker_uid)  # e.g. planted in a shared folder: its owner knows the key
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    out = subprocess.run([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen",
                          f"127.0.0.1:{free_port()}", "--auth-key", str(key_file)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and f"belongs to uid {attacker_uid[0]}" in out.stderr, out.stderr


def test_a_runtime_folder_another_user_made_says_how_to_recover(as_attacker, child_env):
    """Another uid made the victim's embedded-orchestrator folder first: refused, and the refusal says what to do."""
    shared = Path(tempfile.mkdtemp(prefix="rota-shared-"))  # like /tmp
    os.chmod(shared, 0o1777)
    squatted = shared / "rota-0"
    done = as_attacker(f"import os; os.mkdir({str(squatted)!r}, 0o700)")
    assert done.returncode == 0, done.stderr
    env = dict(child_env, ROTA_RUNTIME_DIR=str(squatted))
    out = subprocess.run([sys.executable, "-c", "import rota; rota.connect(group='g', tenant='t')"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "ConfigError" in last and "set ROTA_RUNTIME_DIR to a folder of yours" in last, last
    assert os.listdir(squatted) == []  # nothing of the victim's went into it
    shutil.rmtree(shared, ignore_errors=True)
