"""rota_etcd over https:// with client certificates: a real etcd started with TLS and client-cert auth
(certificates made here with openssl), a real replica that takes a turn through it, and the clear
errors of a half-given TLS configuration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

import rota
from rota.errors import ConfigError
from rota.testing import free_port
from rota_etcd._etcd import tls_credentials
from rota_etcd.testing import ETCD, OrchestratorProcess


def _openssl(folder, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_etcd(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    _openssl(tmp_path, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=etcd test CA")
    (tmp_path / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("member", "client"):
        _openssl(tmp_path, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}")
        _openssl(tmp_path, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", "ext")
    client, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{client}"
    proc = subprocess.Popen([ETCD, "--name", "m0", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
                             f"m0=http://127.0.0.1:{peer}", "--cert-file", str(tmp_path / "member.pem"),
                             "--key-file", str(tmp_path / "member.key"), "--client-cert-auth",
                             "--trusted-ca-file", str(tmp_path / "ca.pem"), "--log-level", "warn", "--logger", "zap"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"ROTA_ETCD_CA": str(tmp_path / "ca.pem"), "ROTA_ETCD_CERT": str(tmp_path / "client.pem"),
           "ROTA_ETCD_KEY": str(tmp_path / "client.key")}
    try:
        yield url, env
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_replica_serves_through_an_etcd_that_checks_client_certificates(tls_etcd, tmp_path, child_env):
    url, tls_env = tls_etcd
    env = {**child_env, **tls_env}
    with OrchestratorProcess(url, tmp_path / "replica.log", env=env).start(timeout=30) as replica:
        gpu = rota.connect(group="g", tenant="j", endpoint=replica.endpoint)
        with gpu.turn() as grant:
            assert grant.token == 1
        gpu.close()
    out = subprocess.run([sys.executable, "-m", "rota", "status", "--etcd", url, "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"group_id": "g"' in out.stdout, out.stderr
    bare = {k: v for k, v in env.items() if not k.startswith("ROTA_ETCD_")} | {"ROTA_ETCD_CA": tls_env["ROTA_ETCD_CA"]}
    t0 = time.monotonic()
    refused = subprocess.run([sys.executable, "-m", "rota", "status", "--etcd", url], env=bare,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and time.monotonic() - t0 < 50  # no client certificate: etcd refuses


def test_half_given_tls_settings_are_clear_errors(monkeypatch):
    for k in ("ROTA_ETCD_CA", "ROTA_ETCD_CERT", "ROTA_ETCD_KEY"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="ROTA_ETCD_CA is not set"):
        tls_credentials("https://127.0.0.1:2379")
    with pytest.raises(ConfigError, match="mixes http:// and https://"):
        tls_credentials("https://a:2379,http://b:2379")
    monkeypatch.setenv("ROTA_ETCD_CA", os.devnull)
    with pytest.raises(ConfigError, match="use https:// URLs"):
        tls_credentials("http://127.0.0.1:2379")
    monkeypatch.setenv("ROTA_ETCD_CERT", os.devnull)
    with pytest.raises(ConfigError, match="set both ROTA_ETCD_CERT and ROTA_ETCD_KEY"):
        tls_credentials("https://127.0.0.1:2379")
