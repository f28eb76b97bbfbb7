"""Issue 30, item 6: ``/metrics`` of the orchestrator.

The attacker read an unauthenticated ``/metrics`` that listed every group and job id that
``Status`` hides from tenants, and saw it keep the series of 12,000 collected groups (40 MB).
Here ``rota orchestrator serve --auth-key`` runs as users run it and is scraped with no token,
a tenant's token and an admin token; with ``--metrics-hash-ids`` no raw id is served. The
series test runs the engine in-process with a one-second idle-group TTL.
"""

from __future__ import annotations

import re
import subprocess
import time

import httpx

import rota
from rota import auth
from rota._orchestrator.metrics import OrchestratorMetrics
from rota.metrics_http import serve_metrics
from rota.orchestrator import OrchestratorConfig
from rota.testing import free_port, running_orchestrator
from tests.security.procs import serving


def _serve(args: list[str]) -> tuple[subprocess.Popen, list[str]]:
    return serving(["orchestrator", "serve", *args])


def _scrape(url: str, token: str = "") -> httpx.Response:
    return httpx.get(url, headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=10)


def test_tenant_ids_need_an_admin_token_or_are_hashed(tmp_path):
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    key = auth.load_key(key_file)
    for hashed in (False, True):
        endpoint, mport = f"127.0.0.1:{free_port()}", free_port()
        proc, lines = _serve(["--listen", endpoint, "--auth-key", key_file, "--metrics-listen", f"127.0.0.1:{mport}",
                              *(["--metrics-hash-ids"] if hashed else [])])
        victim = rota.connect(group="secret-team", tenant="victim-job-7", endpoint=endpoint,
                              token=auth.issue(key, group="secret-team", job="victim-job-7"))
        try:
            victim.acquire()
            url = f"http://127.0.0.1:{mport}/metrics"
            if not hashed:
                for token in ("", auth.issue(key, group="other", job="mallory"), "not-a-token"):
                    r = _scrape(url, token)
                    assert r.status_code == 401 and "victim-job-7" not in r.text and "secret-team" not in r.text
                r = _scrape(url, auth.issue(key, admin=True))
                assert r.status_code == 200 and 'job="victim-job-7"' in r.text
            else:
                r = _scrape(url)
                assert r.status_code == 200 and "victim-job-7" not in r.text and "secret-team" not in r.text
                assert re.search(r'rota_group_holder\{group="h-[0-9a-f]{12}",job="h-[0-9a-f]{12}"\} 1', r.text)
            assert not any("WARNING" in line for line in lines)  # loopback: no warning
            victim.release()
        finally:
            victim.close()
            proc.terminate()
            proc.wait(10)


def test_a_metrics_listener_beyond_loopback_is_warned_about(tmp_path):
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    proc, lines = _serve(["--listen", f"127.0.0.1:{free_port()}", "--auth-key", key_file, "--metrics-listen",
                          f"0.0.0.0:{free_port()}"])
    proc.terminate()
    proc.wait(10)
    assert any("WARNING: /metrics on 0.0.0.0" in line for line in lines), lines


def test_a_collected_groups_series_are_dropped():
    key = b"k" * 32
    config = OrchestratorConfig(ttl_s=3.0, idle_group_ttl_s=1.0, ended_tenant_ttl_s=1.0)
    with running_orchestrator(config, auth=auth.ServerAuth(key=key)) as (endpoint, engine):
        metrics = OrchestratorMetrics(lambda: dict(engine.groups))
        engine.report_metrics_to(metrics)
        port = free_port()
        server = serve_metrics(metrics.registry, "127.0.0.1", port, auth=auth.ServerAuth(key=key))
        admin = auth.issue(key, admin=True)
        try:
            for i in range(30):
                g = rota.connect(group=f"gone-{i}", tenant="t", endpoint=endpoint,
                                 token=auth.issue(key, group=f"gone-{i}", job="t"))
                g.acquire()
                g.release()
                g.close()
            text = _scrape(f"http://127.0.0.1:{port}/metrics", admin).text
            assert text.count('rota_grants_total{group="gone-') == 30
            deadline = time.monotonic() + 30
            while engine.groups and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not engine.groups
            text = _scrape(f"http://127.0.0.1:{port}/metrics", admin).text
            assert "gone-" not in text, [line for line in text.splitlines() if "gone-" in line][:5]
        finally:
            server.shutdown()


def test_the_agents_metrics_need_an_admin_token_too(start_agent):
    """The node agent's /metrics names each job with residue: with --auth-key only an admin token reads it."""
    mport = free_port()
    agent = start_agent("--metrics-listen", f"127.0.0.1:{mport}")
    url = f"http://127.0.0.1:{mport}/metrics"
    for token in ("", agent.token("mallory")):
        assert _scrape(url, token).status_code == 401
    r = _scrape(url, agent.token(admin=True))
    assert r.status_code == 200 and "rota_agent_jobs" in r.text
