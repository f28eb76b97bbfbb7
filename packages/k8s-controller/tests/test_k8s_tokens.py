"""Job tokens on Kubernetes: the controller writes each job's token into a Secret of its namespace,
and `rota k8s install-key` turns the auth key Secret into the file the servers accept.

Kubernetes is FakeKubeApi (rota_k8s_controller.testing), a SMALL FAKE of the pod list/watch and
Secret write endpoints: no API server can run here. The orchestrator is real (rota.v1 over
gRPC on loopback) and checks tokens with the same key the controller issues them with.
"""

from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rota import auth
from rota.errors import ConfigError
from rota.testing import eventually, running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota_k8s_controller._keys import install_key
from rota_k8s_controller.controller import Controller, TokenSecrets, grpc_evictor
from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL
from rota_k8s_controller.testing import FakeKubeApi

KEY = b"s" * 32
JOB = {"apiVersion": "batch/v1", "kind": "Job", "name": "rota-ppo-1", "uid": "job-uid-1"}


def labels(job: str, group: str = "grp0") -> dict[str, str]:
    return {JOB_LABEL: job, GROUP_LABEL: group}


def token_in(fake_api: FakeKubeApi, name: str, namespace: str) -> str:
    secret = fake_api.secret(name, namespace)
    assert secret is not None, f"no Secret {namespace}/{name}"
    return base64.b64decode(secret["data"]["token"]).decode()


@pytest.fixture
def served() -> Iterator[tuple[str, Any]]:
    with running_orchestrator(auth=auth.ServerAuth(key=KEY)) as s:
        yield s


@pytest.fixture
def controller(core_api: Any, served: tuple[str, Any], fake_api: FakeKubeApi) -> Iterator[Controller]:
    fake_api.secret_namespaces = {"team-a", "team-b"}  # where the controller's Roles are
    ctl = Controller(core_api, grpc_evictor(served[0], key=KEY), namespaces=("team-a", "team-b"),
                     tokens=TokenSecrets(core_api, KEY, ttl_s=3600), watch_timeout=2, retry_delay=0.1)
    thread = threading.Thread(target=ctl.run, daemon=True)
    thread.start()
    yield ctl
    ctl.stop()
    thread.join(15)
    assert not thread.is_alive(), "controller did not stop"


def test_a_jobs_token_acts_for_that_job_and_its_secret_goes_with_it(
        fake_api: FakeKubeApi, served: tuple[str, Any], controller: Controller) -> None:
    endpoint, engine = served
    fake_api.create_pod("ppo-1-0", namespace="team-a", labels=labels("ppo-1"), owner=JOB)
    fake_api.create_pod("ppo-1-1", namespace="team-a", labels=labels("ppo-1"), owner=JOB)
    token = eventually(lambda: fake_api.secret("rota-token-ppo-1", "team-a") and
                     token_in(fake_api, "rota-token-ppo-1", "team-a"), "the job's Secret")
    secret = fake_api.secret("rota-token-ppo-1", "team-a")
    assert secret["metadata"]["ownerReferences"] == [JOB]  # collected with the Job if the controller is gone
    assert secret["metadata"]["labels"][JOB_LABEL] == "ppo-1" and secret["type"] == "Opaque"
    assert fake_api.secret_writes == [("POST", "team-a", "rota-token-ppo-1")]  # one per job, not per pod
    principal = auth.verify(KEY, token)
    assert (principal.group, principal.job, principal.admin) == ("team-a.grp0", "team-a.ppo-1", False)

    stub = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=token))
    stub.Acquire(pb.TurnRequest(job_id="team-a.ppo-1", group_id="team-a.grp0"), timeout=30)
    assert engine.groups["team-a.grp0"].holder == "team-a.ppo-1"

    fake_api.delete_pod("ppo-1-0", namespace="team-a")
    fake_api.delete_pod("ppo-1-1", namespace="team-a")
    # the controller's own Evict (an admin token from the same key) frees the group, then the Secret goes
    eventually(lambda: engine.groups["team-a.grp0"].holder == "", "the job's eviction")
    eventually(lambda: fake_api.secret("rota-token-ppo-1", "team-a") is None, "the job's Secret to be deleted")
    assert fake_api.secret_writes[-1] == ("DELETE", "team-a", "rota-token-ppo-1")


def test_a_secret_left_from_before_is_replaced_and_other_namespaces_get_none(
        fake_api: FakeKubeApi, controller: Controller) -> None:
    stale = auth.issue(KEY, group="team-b.grp0", job="team-b.sft-2", ttl_s=1, now=0)  # long expired
    with fake_api.cond:
        fake_api.secrets[("team-b", "rota-token-sft-2")] = {
            "metadata": {"name": "rota-token-sft-2", "namespace": "team-b"},
            "data": {"token": base64.b64encode(stale.encode()).decode()}}
    fake_api.create_pod("sft-2-0", namespace="team-b", labels=labels("sft-2"))
    eventually(lambda: ("PUT", "team-b", "rota-token-sft-2") in fake_api.secret_writes,
               "the stale Secret's replacement")
    fresh = token_in(fake_api, "rota-token-sft-2", "team-b")
    assert fresh != stale and auth.verify(KEY, fresh).job == "team-b.sft-2"

    # A namespace the controller does not watch: no Secret is even tried there.
    fake_api.create_pod("x-0", namespace="elsewhere", labels=labels("x"))
    fake_api.create_pod("y-0", namespace="team-a", labels=labels("y"))  # a later event in a watched one
    eventually(lambda: fake_api.secret("rota-token-y", "team-a"), "the later job's Secret")
    assert not [w for w in fake_api.secret_writes if w[1] == "elsewhere"]


def test_a_jobs_token_allows_its_pods_priority_up_to_the_controllers_max(
        fake_api: FakeKubeApi, core_api: Any, served: tuple[str, Any]) -> None:
    """A tenant asks ROTA_PRIORITY in its pod; its token allows that up to --max-priority (3 here), so the
    orchestrator (--auth-key) grants priority 3 and refuses 7; a pod asking none gets a token allowing 0."""
    endpoint, _ = served
    fake_api.secret_namespaces = {"team-a"}
    ctl = Controller(core_api, grpc_evictor(endpoint, key=KEY), namespaces=("team-a",),
                     tokens=TokenSecrets(core_api, KEY, max_priority=3), watch_timeout=1, retry_delay=0.05)
    thread = threading.Thread(target=ctl.run, daemon=True)
    thread.start()
    try:
        fake_api.create_pod("hi-0", namespace="team-a", labels=labels("hi"), env={"ROTA_PRIORITY": "7"})
        fake_api.create_pod("lo-0", namespace="team-a", labels=labels("lo"))
        hi = eventually(lambda: fake_api.secret("rota-token-hi", "team-a") and
                        token_in(fake_api, "rota-token-hi", "team-a"), "the job's Secret")
        lo = eventually(lambda: fake_api.secret("rota-token-lo", "team-a") and
                        token_in(fake_api, "rota-token-lo", "team-a"), "the other job's Secret")
        assert auth.verify(KEY, hi).max_priority == 3 and auth.verify(KEY, lo).max_priority is None
        stub = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=hi))
        with pytest.raises(grpc.RpcError) as info:
            stub.Acquire(pb.TurnRequest(job_id="team-a.hi", group_id="team-a.grp0", priority=7), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stub.Acquire(pb.TurnRequest(job_id="team-a.hi", group_id="team-a.grp0", priority=3), timeout=10)
    finally:
        ctl.stop()
        thread.join(15)


def test_a_refused_secret_write_is_not_retried_forever(fake_api: FakeKubeApi, core_api: Any,
                                                     served: tuple[str, Any]) -> None:
    fake_api.secret_namespaces = set()  # no Role anywhere: every write is 403
    ctl = Controller(core_api, grpc_evictor(served[0], key=KEY), namespaces=("team-a",),
                     tokens=TokenSecrets(core_api, KEY), watch_timeout=1, retry_delay=0.05)
    thread = threading.Thread(target=ctl.run, daemon=True)
    thread.start()
    try:
        fake_api.create_pod("ppo-1-0", namespace="team-a", labels=labels("ppo-1"))
        eventually(lambda: ("team-a", "grp0", "ppo-1") in ctl.issued, "the controller to give up on the Secret")
        before = fake_api.watch_count()
        eventually(lambda: fake_api.watch_count() >= before + 2, "two more watch rounds")
        assert fake_api.secrets == {} and fake_api.secret_refusals == [("POST", "team-a", "rota-token-ppo-1")]
    finally:
        ctl.stop()
        thread.join(15)


# ------------------------------------------------------------------ rota k8s install-key


def kubelet_secret_dir(root: Path, content: bytes) -> Path:
    """A directory laid out as the kubelet mounts a Secret: key -> ..data/key -> ..<ts>/key, mode 0440."""
    ts = root / "..2026_01_01_00_00_00.000000001"
    ts.mkdir(parents=True)
    (ts / "key").write_bytes(content)
    os.chmod(ts / "key", 0o440)
    (root / "..data").symlink_to(ts.name)
    (root / "key").symlink_to("..data/key")
    return root / "key"


def test_install_key_makes_the_file_load_key_accepts(tmp_path: Path) -> None:
    auth.generate_key(str(tmp_path / "made.key"))
    made = (tmp_path / "made.key").read_bytes()
    source = kubelet_secret_dir(tmp_path / "secret", made)
    with pytest.raises(ConfigError):  # what the servers would say about the Secret as mounted
        auth.load_key(str(source))
    dest = tmp_path / "auth" / "key"
    dest.parent.mkdir()
    for _ in range(2):  # an init container that runs again replaces its file
        out = subprocess.run([sys.executable, "-m", "rota", "k8s", "install-key", str(source), str(dest)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    st = dest.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert auth.load_key(str(dest)) == auth.load_key(str(tmp_path / "made.key"))
    assert sorted(p.name for p in dest.parent.iterdir()) == ["key"]  # no temporary left behind


@pytest.mark.parametrize("content", [b"not-a-key-but-a-secret-value", b"x" * 5000])
def test_install_key_refuses_what_is_no_key_without_quoting_it(tmp_path: Path, content: bytes) -> None:
    source = kubelet_secret_dir(tmp_path / "secret", content)
    dest = tmp_path / "key"
    with pytest.raises(ConfigError) as info:
        install_key(str(source), str(dest))
    assert "rota token keygen" in str(info.value) and content.decode()[:20] not in str(info.value)
    assert not dest.exists() and [p.name for p in tmp_path.iterdir()] == ["secret"]


def test_install_key_names_a_missing_secret(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kubectl create secret generic rota-auth"):
        install_key(str(tmp_path / "missing"), str(tmp_path / "key"))


def test_the_controllers_evict_without_a_key_is_refused_by_a_checking_orchestrator(
        served: tuple[str, Any]) -> None:
    """The admin token is what lets the controller evict: without the key its Evict is UNAUTHENTICATED."""
    from rota.errors import Unauthenticated
    from rota_k8s_controller.controller import Eviction

    endpoint, engine = served
    stub = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="ns.g", job="ns.j")))
    stub.Acquire(pb.TurnRequest(job_id="ns.j", group_id="ns.g"), timeout=30)
    with pytest.raises(Unauthenticated):
        grpc_evictor(endpoint)(Eviction("ns.g", "ns.j", "pod ns/j-0 deleted"))
    assert engine.groups["ns.g"].holder == "ns.j"
    grpc_evictor(endpoint, key=KEY)(Eviction("ns.g", "ns.j", "pod ns/j-0 deleted"))
    assert engine.groups["ns.g"].holder == ""
