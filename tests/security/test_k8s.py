"""Issue 17, rows 22 and 23: rota on Kubernetes, attacked through what `rota k8s` renders.

No Kubernetes cluster runs here. What can run for real does: etcd started with exactly the
TLS flags the StatefulSet renders, the agent started with exactly its rendered command
(after the rendered init container's `rota k8s install-key`), the orchestrator checking
tokens, and the controller issuing them. The API server is FakeKubeApi
(rota_k8s_controller.testing), a SMALL FAKE of the pod list/watch and
Secret write endpoints; NetworkPolicies and Pod Security Admission are enforced by a
cluster, so their objects are checked against the official schemas and the published
``restricted`` rules (k8s_checks.restricted_problems).
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import yaml
from click.testing import CliRunner

import rota
from rota import auth
from rota.testing import free_port, running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota.wire import snapshot_agent_pb2 as agent_pb
from rota.wire import snapshot_agent_pb2_grpc as agent_grpc
from rota_k8s import load_values, render, validate_objects
from rota_k8s.manifests import AUTH_DIR, AUTH_SECRET_DIR, ETCD_TLS_DIR, GROUP_LABEL
from rota_k8s_controller.controller import Controller, TokenSecrets, grpc_evictor
from rota_k8s_controller.testing import FakeKubeApi

K8S_TESTS = Path(__file__).resolve().parents[2] / "packages" / "scheduler-k8s" / "tests"
KEY = b"k" * 32
TENANTS = ["team-a", "other-team"]


def _sibling(name: str) -> ModuleType:
    """A helper module of the scheduler-k8s tests (not an installed package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, K8S_TESTS / f"{name}.py")
        assert spec and spec.loader
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


checks = _sibling("k8s_checks")


def workloads(objs: list[dict[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """{name: (namespace, pod spec)} of every workload."""
    return {o["metadata"]["name"]: (o["metadata"]["namespace"], o["spec"]["template"]["spec"])
            for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")}


def command_of(spec: dict[str, Any], container: str) -> list[str]:
    (c,) = [c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == container]
    return c["command"]


def localized(argv: list[str], paths: dict[str, str], env: dict[str, str]) -> list[str]:
    """``argv`` with the pod's paths mapped to this machine's and ``$(VAR)`` expanded, as the kubelet would."""
    out = []
    for arg in argv:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        for pod_path, here in paths.items():
            arg = arg.replace(pod_path, here)
        out.append(arg)
    return out


# ------------------------------------------------------------------ certificates (the README's openssl recipe)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(folder: Path) -> None:
    """etcd's CA, a member certificate (server and peer), the orchestrator's client certificate, and an
    attacker's certificate from a CA of its own."""
    ext = folder / "ext"
    for ca in ("ca", "evil-ca"):
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
                "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-subj", f"/CN=rota-{ca}", cwd=folder)
    for name, ca, usage, san in (
            ("member", "ca", "serverAuth,clientAuth",
             "DNS:*.rota-etcd.rota-system.svc,DNS:*.rota-etcd.rota-system.svc.cluster.local,DNS:localhost,"
             "IP:127.0.0.1"),
            ("client", "ca", "clientAuth", "DNS:rota-orchestrator"),
            ("evil", "evil-ca", "clientAuth", "DNS:rota-orchestrator")):
        ext.write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-days", "1", "-extfile", "ext", "-out", f"{name}.crt", cwd=folder)
    tls = folder / "member-secret"  # the Secret's layout: tls.crt, tls.key, ca.crt
    tls.mkdir()
    for src, dst in (("member.crt", "tls.crt"), ("member.key", "tls.key"), ("ca.crt", "ca.crt")):
        shutil.copy(folder / src, tls / dst)


def etcd_call(url: str, path: str, body: dict[str, str], *, ca: Path | None = None,
              cert: tuple[Path, Path] | None = None) -> dict[str, Any]:
    """One call to etcd's JSON gateway (``/v3/kv/...``), over TLS when ``ca`` is given."""
    ctx = None
    if ca is not None:
        ctx = ssl.create_default_context(cafile=str(ca))
        if cert:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
        return json.loads(resp.read())


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def start_rendered_etcd(cmd: list[str], tmp: Path) -> tuple[subprocess.Popen, str, str]:
    """etcd with the StatefulSet's flags; only addresses, data dir and the one-member cluster are local."""
    client, peer, metrics = free_port(), free_port(), free_port()
    flags = dict(arg.split("=", 1) for arg in cmd[1:])
    local = {"--data-dir": str(tmp / "data"), "--name": "rota-etcd-0",
             "--listen-client-urls": f"https://127.0.0.1:{client}",
             "--advertise-client-urls": f"https://127.0.0.1:{client}",
             "--listen-peer-urls": f"https://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer}",
             "--initial-cluster": f"rota-etcd-0=https://127.0.0.1:{peer}",
             "--listen-metrics-urls": f"http://127.0.0.1:{metrics}"}
    assert set(local) <= set(flags), sorted(flags)
    flags.update(local)
    argv = ["etcd", *(f"{k}={v.replace(ETCD_TLS_DIR, str(tmp / 'member-secret'))}" for k, v in flags.items())]
    with open(tmp / "etcd.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    health = f"http://127.0.0.1:{metrics}/health"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(health, timeout=1) as resp:  # what the kubelet's probe asks
                if json.loads(resp.read()).get("health") == "true":
                    return proc, f"https://127.0.0.1:{client}", f"http://127.0.0.1:{client}"
        except (OSError, ValueError):
            time.sleep(0.2)
    proc.kill()
    pytest.fail(f"rendered etcd did not become healthy: {(tmp / 'etcd.log').read_text()[-2000:]}")


# ------------------------------------------------------------------ row 22


def check_rendered_objects(objs: list[dict[str, Any]]) -> None:
    """The cluster side's properties, as a cluster would enforce them."""
    validate_objects(objs)  # strict, against the official schemas of every release from 1.34
    text = yaml.safe_dump_all(objs)
    assert "Secret" not in {o["kind"] for o in objs} and "stringData" not in text and "--insecure" not in text
    by = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}
    ns, agent_ns = "rota-system", "rota-system-agent"

    # Pod Security: rota's namespace restricted, only the agent's privileged, and every rota pod passes.
    level = {name: o["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
             for (kind, _, name), o in by.items() if kind == "Namespace"}
    assert level == {ns: "restricted", agent_ns: "privileged"}
    pods = workloads(objs)
    for name, (where, spec) in pods.items():
        assert where == (agent_ns if name == "rota-agent" else ns), name
        if where == ns:
            assert checks.restricted_problems(spec) == [], name

    # RBAC: nothing cluster-wide; in the tenant namespaces pods read, Secrets written and never read.
    assert not [k for k in by if k[0] in ("ClusterRole", "ClusterRoleBinding")]
    roles = {k[1]: o["rules"] for k, o in by.items() if k[0] == "Role"}
    assert set(roles) == set(TENANTS)
    for rules in roles.values():
        verbs = {r["resources"][0]: set(r["verbs"]) for r in rules}
        assert verbs == {"pods": {"get", "list", "watch"}, "secrets": {"create", "update", "delete"}}

    # NetworkPolicies: deny by default; etcd from the orchestrator (and its peers), the orchestrator and the
    # agent from tenant pods of the tenant namespaces and the orchestrator only.
    policies = {(k[1], k[2]): o["spec"] for k, o in by.items() if k[0] == "NetworkPolicy"}
    assert policies[(ns, "rota-default-deny")] == policies[(agent_ns, "rota-default-deny")] == {
        "podSelector": {}, "policyTypes": ["Ingress"], "ingress": []}
    orchestrator_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rota-orchestrator",
                                                         "app.kubernetes.io/part-of": "rota"}}}
    tenant_pods = {"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                                                               "operator": "In", "values": TENANTS}]},
                   "podSelector": {"matchExpressions": [{"key": GROUP_LABEL, "operator": "Exists"}]}}
    etcd = policies[(ns, "rota-etcd")]
    assert etcd["ingress"][0] == {"from": [orchestrator_pods], "ports": [{"protocol": "TCP", "port": 2379}]}
    assert etcd["ingress"][1]["ports"] == [{"protocol": "TCP", "port": 2380}] and len(etcd["ingress"]) == 2
    assert policies[(ns, "rota-orchestrator")]["ingress"] == [
        {"from": [orchestrator_pods, tenant_pods], "ports": [{"protocol": "TCP", "port": 50051}]}]
    from_rota = {**orchestrator_pods, "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    assert policies[(agent_ns, "rota-agent")]["ingress"] == [
        {"from": [from_rota, tenant_pods], "ports": [{"protocol": "TCP", "port": 9001}]}]

    # The agent: on its pod's address only (no hostPort, no host network), with the auth key.
    _, agent = pods["rota-agent"]
    (container,) = agent["containers"]
    assert not agent.get("hostNetwork") and not any("hostPort" in p for p in container["ports"])
    cmd = container["command"]
    assert cmd[cmd.index("--listen") + 1] == "$(POD_IP):9001" and "--insecure" not in cmd
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]

    # The orchestrator and the controller read the owner-only copy of the key the operator's Secret holds.
    _, orch = pods["rota-orchestrator"]
    serve, controller = command_of(orch, "orchestrator"), command_of(orch, "controller")
    assert serve[serve.index("--auth-key") + 1] == controller[controller.index("--auth-key") + 1] == \
        f"{AUTH_DIR}/key" == command_of(orch, "install-auth-key")[-1]
    assert {"name": "auth-secret", "secret": {"secretName": "rota-auth", "defaultMode": 0o440,
                                              "items": [{"key": "key", "path": "key"}]}} in orch["volumes"]
    assert {"name": "auth", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in orch["volumes"]

    # etcd: clients and peers over TLS with certificates of its CA; plain HTTP only for the kubelet's /health.
    flags = dict(arg.split("=", 1) for arg in command_of(pods["rota-etcd"][1], "etcd")[1:])
    assert flags["--client-cert-auth"] == flags["--peer-client-cert-auth"] == "true"
    assert flags["--trusted-ca-file"] == flags["--peer-trusted-ca-file"] == f"{ETCD_TLS_DIR}/ca.crt"
    assert [k for k, v in flags.items() if "http://" in v] == ["--listen-metrics-urls"]

    # etcd's clients: https only, with the orchestrator's certificate from its Secret.
    urls = serve[serve.index("--etcd") + 1].split(",")
    assert urls and all(u.startswith("https://") for u in urls)
    env = {e["name"]: e.get("value") for e in orch["containers"][0]["env"]}
    assert env == {"ROTA_ETCD_CA": "/etc/rota/etcd-tls/ca.crt", "ROTA_ETCD_CERT": "/etc/rota/etcd-tls/tls.crt",
                   "ROTA_ETCD_KEY": "/etc/rota/etcd-tls/tls.key",
                   "POD_IP": None, "ROTA_ADVERTISE": "$(POD_IP):50051"}  # followers redirect to the leader's pod


@pytest.mark.skipif(shutil.which("etcd") is None or shutil.which("openssl") is None,
                    reason="needs the etcd binary and openssl")
def test_row22_rendered_cluster_admits_only_credentialed_peers(tmp_path: Path) -> None:
    objs = render(load_values(overrides={"tenantNamespaces": TENANTS}))
    check_rendered_objects(objs)
    pods = workloads(objs)

    # etcd, run with the StatefulSet's flags: nobody without a certificate of its CA can write rota's keys.
    make_certs(tmp_path)
    proc, url, plain_url = start_rendered_etcd(command_of(pods["rota-etcd"][1], "etcd"), tmp_path)
    try:
        ca, put = tmp_path / "ca.crt", {"key": b64("/rota/groups/g0"), "value": b64("attacker")}
        attempts = {"plain http": lambda: etcd_call(plain_url, "/v3/kv/put", put),
                    "no client certificate": lambda: etcd_call(url, "/v3/kv/put", put, ca=ca),
                    "another CA's certificate": lambda: etcd_call(
                        url, "/v3/kv/put", put, ca=ca, cert=(tmp_path / "evil.crt", tmp_path / "evil.key"))}
        for what, attempt in attempts.items():
            with pytest.raises((OSError, http.client.HTTPException)):  # URLError, SSLError are OSErrors
                attempt()
                pytest.fail(f"etcd took a write with {what}")
        client = (tmp_path / "client.crt", tmp_path / "client.key")
        seen = etcd_call(url, "/v3/kv/range", {"key": b64("/rota/groups/g0")}, ca=ca, cert=client)
        assert "kvs" not in seen  # nothing was written
        etcd_call(url, "/v3/kv/put", {"key": b64("/rota/probe"), "value": b64("ok")}, ca=ca, cert=client)
    finally:
        proc.terminate()
        proc.wait(20)

    # The agent, run with its rendered init container and command: a caller without a token gets nothing.
    _, agent = pods["rota-agent"]
    key_file, secret_dir, auth_dir = tmp_path / "rota.key", tmp_path / "auth-secret", tmp_path / "auth"
    auth.generate_key(str(key_file))
    secret_dir.mkdir()
    auth_dir.mkdir()
    shutil.copy(key_file, secret_dir / "key")
    os.chmod(secret_dir / "key", 0o440)  # as the kubelet mounts a Secret for an fsGroup
    paths = {AUTH_SECRET_DIR: str(secret_dir), AUTH_DIR: str(auth_dir)}
    port = free_port()
    pod_env = {"POD_IP": "127.0.0.1"}
    init = localized(command_of(agent, "install-auth-key"), paths, pod_env)
    subprocess.run([sys.executable, "-m", *init], check=True, capture_output=True, timeout=120)
    serve = localized(command_of(agent, "agent"), paths, pod_env)
    serve[serve.index("--listen") + 1] = f"127.0.0.1:{port}"  # the pod's address, here loopback
    proc = subprocess.Popen([sys.executable, "-m", *serve], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        endpoint = f"127.0.0.1:{port}"
        with grpc.insecure_channel(endpoint) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            stub = agent_grpc.SnapshotAgentServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Status(agent_pb.StatusRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.Snapshot(agent_pb.SnapshotRequest(job_id="team-a.victim", group="team-a.g0"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            admin = auth.bearer(auth.issue(auth.load_key(str(auth_dir / "key")), admin=True))
            assert list(stub.Status(agent_pb.StatusRequest(), timeout=10, metadata=admin).job_statuses) == []
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


# ------------------------------------------------------------------ row 23


def tenant_pod(cli: Any, namespace: str, job: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`rota k8s tenant ... --kind pod`: the rendered pod's metadata and spec (exit code checked)."""
    result = CliRunner().invoke(cli, ["k8s", "tenant", "--namespace", namespace, "--group", "g0", "--job-id", job,
                                      "--kind", "pod", "--image", "reg.example/ppo:1", "--", "python", "train.py"])
    assert result.exit_code == 0, result.output
    (_, pod) = yaml.safe_load_all(result.stdout)
    return pod["metadata"], pod["spec"]


def the_pods_env(fake: Any, meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, str]:
    """What the kubelet gives the pod once the controller wrote the job's Secret."""
    ref = next(e["valueFrom"]["secretKeyRef"] for e in spec["containers"][0]["env"] if e["name"] == "ROTA_TOKEN")
    secret = checks.wait_for(lambda: fake.secret(ref["name"], meta["namespace"]),
                             f"the controller to write {meta['namespace']}/{ref['name']}")
    token = base64.b64decode(secret["data"][ref["key"]]).decode()
    return checks.pod_env(meta, spec, secrets={(ref["name"], ref["key"]): token})


@pytest.fixture
def rota_cli() -> Any:
    from rota.testing import cli_with_plugins

    return cli_with_plugins()


def test_row23_a_job_id_in_another_namespace_is_another_job(rota_cli: Any) -> None:
    fake = FakeKubeApi().start()
    fake.secret_namespaces = set(TENANTS)
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = fake.url
    core = client.CoreV1Api(client.ApiClient(cfg))
    with running_orchestrator(auth=auth.ServerAuth(key=KEY)) as (endpoint, engine):
        ctl = Controller(core, grpc_evictor(endpoint, key=KEY), namespaces=TENANTS,
                         tokens=TokenSecrets(core, KEY), watch_timeout=2, retry_delay=0.1)
        thread = threading.Thread(target=ctl.run, daemon=True)
        thread.start()
        victim = None
        try:
            # The victim: team-a's job "victim", holding its group with the token its Secret gave it.
            v_meta, v_spec = tenant_pod(rota_cli, "team-a", "victim")
            fake.create_pod(v_meta["name"], namespace="team-a", labels=v_meta["labels"])
            v_env = the_pods_env(fake, v_meta, v_spec)
            victim = rota.connect(group=v_env["ROTA_GROUP"], tenant=v_env["ROTA_TENANT"], endpoint=endpoint,
                                  token=v_env["ROTA_TOKEN"])
            grant = victim.acquire()
            victim_secret = fake.secret("rota-token-victim", "team-a")

            # The attack: the exact input of row 23. Rendering is the attacker's own business, and the pods
            # run restricted; what matters is which job the controller takes them for.
            a_meta, a_spec = tenant_pod(rota_cli, "other-team", "victim")
            assert checks.restricted_problems(a_spec) == []
            fake.create_pod(a_meta["name"], namespace="other-team", labels=a_meta["labels"])
            a_env = the_pods_env(fake, a_meta, a_spec)
            assert (a_env["ROTA_GROUP"], a_env["ROTA_TENANT"]) == ("other-team.g0", "other-team.victim")
            principal = auth.verify(KEY, a_env["ROTA_TOKEN"])
            assert (principal.group, principal.job) == ("other-team.g0", "other-team.victim")

            stub = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=a_env["ROTA_TOKEN"]))
            own = {"job_id": "team-a.victim", "group_id": "team-a.g0"}
            for call in (lambda: stub.Release(pb.ReleaseRequest(**own, token=grant.token), timeout=5),
                         lambda: stub.Evict(pb.EvictRequest(**own, reason="mine now"), timeout=5),
                         lambda: stub.Acquire(pb.TurnRequest(**own), timeout=5)):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            # Its own job is another group's: granted at once, without waiting for the victim's turn.
            stub.Acquire(pb.TurnRequest(job_id="other-team.victim", group_id="other-team.g0"), timeout=5)

            # The attacker's pod going away evicts the attacker's job only.
            fake.delete_pod(a_meta["name"], namespace="other-team")
            checks.wait_for(lambda: [e.job_id for e in ctl.evicted] == ["other-team.victim"],
                            "the controller to evict the attacker's job")
            group = engine.groups["team-a.g0"]
            assert (group.holder, group.token) == ("team-a.victim", grant.token)
            assert fake.secret("rota-token-victim", "team-a") == victim_secret
            assert [w for w in fake.secret_writes if w[1] == "team-a"] == [("POST", "team-a", "rota-token-victim")]

            # Nor does a live pod in another namespace keep the victim's job alive once its own pod is gone.
            fake.create_pod(a_meta["name"], namespace="other-team", labels=a_meta["labels"])
            fake.delete_pod(v_meta["name"], namespace="team-a")
            checks.wait_for(lambda: engine.groups["team-a.g0"].holder == "", "the victim's own pod to end its turn")
        finally:
            if victim is not None:
                victim.close()
            ctl.stop()
            thread.join(15)
            fake.close()
