"""The controller's probe: `rota k8s controller --health-listen` answers /healthz 200 while it hears from the API
server, 503 once no list or watch has succeeded for 3 x --watch-timeout.

Real parts: the `rota k8s controller` process with the official kubernetes client, a real orchestrator, real HTTP
probes. The API server is FakeKubeApi, a fake (no API server runs here) that serves list and watch, and fails
every list once told to.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from rota.testing import eventually, free_port
from rota_k8s_controller.testing import FakeKubeApi

ROTA = str(Path(sys.executable).parent / "rota")


def _probe(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_healthz_follows_the_api_server(fake_api: FakeKubeApi, orchestrator, tmp_path):
    kc = tmp_path / "kubeconfig"
    kc.write_text(f"apiVersion: v1\nkind: Config\nclusters: [{{name: f, cluster: {{server: '{fake_api.url}'}}}}]\n"
                  "users: [{name: u, user: {}}]\ncontexts: [{name: f, context: {cluster: f, user: u}}]\n"
                  "current-context: f\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    ctl = subprocess.Popen([ROTA, "k8s", "controller", "--orchestrator", orchestrator[0], "--kubeconfig", str(kc),
                            "--watch-timeout", "1", "--health-listen", f"127.0.0.1:{port}"], env=env,
                           stderr=subprocess.DEVNULL)
    try:
        eventually(lambda: _try(port), "the probe answering", timeout=60)
        eventually(lambda: _probe(port)[0] == 200, "healthy after the first list", timeout=30)
        assert _probe(port)[1].startswith("ok: the API server was heard from")
        fake_api.fail_next_lists = 10**6  # the API server stops answering lists (watches end each second)
        eventually(lambda: _probe(port)[0] == 503, "unhealthy once out of touch", timeout=60)
        assert "no list or watch of the API server succeeded within 3 s" in _probe(port)[1]
        fake_api.fail_next_lists = 0
        eventually(lambda: _probe(port)[0] == 200, "healthy again", timeout=60)
        assert _probe(port)[0] == 200 and urllib_404(port)
    finally:
        ctl.terminate()
        ctl.wait(timeout=30)


def _try(port: int) -> tuple[int, str] | None:
    try:
        return _probe(port)
    except OSError:
        return None


def urllib_404(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    except urllib.error.HTTPError as err:
        return err.code == 404
    return False
