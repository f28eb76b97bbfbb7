"""`rota orchestrator serve` with TLS and client certificates (mTLS) plus tokens, as a real child process.

Certificates are made here with the openssl command (a test CA, a server certificate for
127.0.0.1, a client certificate); the test skips where openssl is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest

import rota
from rota import auth
from rota.testing import free_port


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=rota test CA", cwd=tmp_path)
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=rota {name}", cwd=tmp_path)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=tmp_path)
    return tmp_path


def test_mtls_and_tokens_admit_only_clients_with_both(pki, tmp_path):
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    server = subprocess.Popen([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen", f"127.0.0.1:{port}",
                               "--auth-key", key_file, "--tls-cert", str(pki / "server.pem"), "--tls-key",
                               str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem")], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert server.poll() is None, server.stderr.read()
        token = auth.issue(auth.load_key(key_file), group="g", job="j")
        tls = {"ROTA_TLS_CA": str(pki / "ca.pem"), "ROTA_TLS_CERT": str(pki / "client.pem"),
               "ROTA_TLS_KEY": str(pki / "client.key")}
        os.environ.update(tls)
        try:
            gpu = rota.connect(group="g", tenant="j", endpoint=f"127.0.0.1:{port}", token=token)
            with gpu.turn() as grant:
                assert grant.token == 1
            gpu.close()
            os.environ.pop("ROTA_TLS_CERT")  # TLS, but no client certificate: the handshake fails
            os.environ.pop("ROTA_TLS_KEY")
            with auth.channel(f"127.0.0.1:{port}", token=token) as ch:
                with pytest.raises(grpc.FutureTimeoutError):
                    grpc.channel_ready_future(ch).result(timeout=2)
        finally:
            for k in tls:
                os.environ.pop(k, None)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # plaintext never gets in
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(ch).result(timeout=2)
    finally:
        server.terminate()
        server.wait(timeout=10)
