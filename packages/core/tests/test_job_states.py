"""Job states say what happened: a tenant process that closes its session is ``ended``, one that is killed is
``lost``, and only the second trips the README's alert (``rota_tenant_state{state=~"faulted|lost"} == 1``).

Real parts: a `rota orchestrator serve` process with --metrics-listen, two tenant processes (tenant_worker.py)
over gRPC on loopback, one killed with SIGKILL while it holds the group, a real HTTP scrape of /metrics and
`rota status --json` / `--prometheus`, parsed with prometheus-client's parser.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rota import admin
from rota.testing import child_environment, eventually, free_port

HERE = pathlib.Path(__file__).parent
ALERT_STATES = ("faulted", "lost")  # the README's alert: max by (group, job) (rota_tenant_state{state=~...}) == 1


def _states(text: str) -> dict[str, str]:
    """job -> the state whose rota_tenant_state sample is 1, from Prometheus text."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["job"]: s.labels["state"] for s in families["rota_tenant_state"].samples if s.value == 1}


def _alerting(text: str) -> set[str]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {s.labels["job"] for s in families["rota_tenant_state"].samples
            if s.labels["state"] in ALERT_STATES and s.value == 1}


def test_a_closed_tenant_is_ended_a_killed_one_lost_and_only_the_killed_one_alerts(tmp_path):
    port, mport = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    env = child_environment(tmp_path / "runtime")
    server = subprocess.Popen([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen", endpoint,
                               "--insecure", "--ttl", "3", "--metrics-listen", f"127.0.0.1:{mport}"],
                              env=env, stderr=subprocess.DEVNULL)
    killed = None
    try:
        worker = [sys.executable, str(HERE / "tenant_worker.py"), endpoint, "g"]
        clean = subprocess.run([*worker, "closes", "2", "0"], env=env, capture_output=True, text=True, timeout=60)
        assert clean.returncode == 0, clean.stderr
        killed = subprocess.Popen([*worker, "killed", "1", "600"], env=env, stdout=subprocess.PIPE, text=True)
        assert killed.stdout is not None and killed.stdout.readline().startswith("granted killed")
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=10)

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()

        eventually(lambda: _states(scrape()).get("killed") == "lost", "the killed tenant shown lost", timeout=30)
        for job in ("closes", "killed"):  # the scheduler's epilog evicts both after they are gone: no change
            assert admin.evict(endpoint, job, "g", reason=f"slurm job {job} ended") == admin.EvictResult(False, False)
        metrics = scrape()
        status = subprocess.run([sys.executable, "-m", "rota", "status", "--json", "--orchestrator", endpoint],
                                env=env, capture_output=True, text=True, timeout=60)
        prom = subprocess.run([sys.executable, "-m", "rota", "status", "--prometheus", "--orchestrator", endpoint],
                              env=env, capture_output=True, text=True, timeout=60)
    finally:
        if killed is not None and killed.poll() is None:
            killed.kill()
        server.terminate()
        server.wait(timeout=10)
    assert status.returncode == 0 and prom.returncode == 0, status.stderr + prom.stderr
    tenants = {t["job_id"]: t for t in json.loads(status.stdout)["groups"][0]["tenants"]}
    assert tenants["closes"]["state"] == "ended" and tenants["closes"]["turns"] == 2
    assert tenants["killed"]["state"] == "lost" and tenants["killed"]["turns"] == 1
    for text in (metrics, prom.stdout):  # the scrape and the one-shot print say the same
        assert _states(text) == {"closes": "ended", "killed": "lost"}
        assert _alerting(text) == {"killed"}
