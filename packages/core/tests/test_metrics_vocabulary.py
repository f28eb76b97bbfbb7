"""One metrics vocabulary: ``/metrics`` and ``rota status --prometheus`` print the same group families with the
same names, labels and values; restores the orchestrator drives are a histogram like parks; the README lists
every family ``/metrics`` serves.

Real parts: an orchestrator (device of 3 U, prefetch through the tenants' rota.v1 sessions) serving gRPC and
/metrics on loopback, tenant processes (prefetch_tenant.py) whose hooks move a payload, a real HTTP scrape and a
real `rota status --prometheus` process, both parsed with prometheus-client's parser.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rota._engine import OrchestratorConfig
from rota._metrics import OrchestratorMetrics
from rota.testing import ScriptedProcess, eventually, free_port, running_orchestrator

HERE = pathlib.Path(__file__).parent
README = HERE.parents[2] / "README.md"
U = 64 << 10


def _families(text: str) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels): value}"""
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def test_metrics_and_status_prometheus_agree_and_restores_are_a_histogram(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(ROTA_RUNTIME_DIR=str(tmp_path / "rt"), PYTHONUNBUFFERED="1", ROTA_LOAD_PLUGINS="")
    config = OrchestratorConfig(ttl_s=3.0, park_timeout_s=20.0, capacity_bytes=3 * U)
    started: list[ScriptedProcess] = []

    def tenant(job: str, units: int) -> ScriptedProcess:
        started.append(ScriptedProcess(str(HERE / "prefetch_tenant.py"), ["--orch", ep, "--job", job, "--group",
                                       "g", "--size", str(units * U)], env, timeout=60))
        return started[-1]

    mport = free_port()
    with running_orchestrator(config) as (ep, engine):
        metrics = OrchestratorMetrics(lambda: engine.groups)
        engine.report_metrics_to(metrics)
        server = metrics.serve("127.0.0.1", mport)
        try:
            b, c, a = tenant("b", 1), tenant("c", 3), tenant("a", 2)
            for t in (b, c, a):  # c parks b, a parks c: a holds, b and c are parked
                t.ask("acquire")
                if t is not a:
                    t.ask("release")
            b.send("acquire")  # b (1 U) fits beside a (2 U): restored ahead of its grant
            g = engine.groups["g"]
            eventually(lambda: g.tenants["b"].state == "resident", "b's prefetch restore")
            a.ask("release")
            assert b.read()["restored"] is False
            b.ask("release")
            c.stop()  # exits after closing its session: ended
            eventually(lambda: g.tenants["c"].state == "ended", "c ended")
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
            printed = subprocess.run([sys.executable, "-m", "rota", "status", "--prometheus", "--orchestrator", ep],
                                     env=env, capture_output=True, text=True, timeout=60)
        finally:
            for t in started:
                t.stop()
            server.shutdown()
    assert printed.returncode == 0, printed.stderr
    served, shown = _families(scraped), _families(printed.stdout)
    assert shown and set(shown) <= set(served)
    for name, samples in shown.items():
        assert samples == served[name], name
    assert shown["rota_group_prefetches"][("rota_group_prefetches_total", (("group", "g"), ("outcome", "hit")))] == 1
    states = {dict(k[1])["job"]: dict(k[1])["state"] for k, v in shown["rota_tenant_state"].items() if v == 1}
    assert states == {"a": "resident", "b": "resident", "c": "ended"}
    restores = served["rota_restore_seconds"]
    assert restores[("rota_restore_seconds_count", (("group", "g"),))] == 1
    assert served["rota_restores"][("rota_restores_total", (("group", "g"), ("outcome", "ok")))] == 1
    assert served["rota_park_seconds"][("rota_park_seconds_count", (("group", "g"),))] == 2

    documented = set(re.findall(r"`(rota_[a-z0-9_]+)", README.read_text()))
    for name in (n for n in served if not n.endswith("_created")):  # counters are named with their _total
        assert name in documented or f"{name}_total" in documented, f"{name} missing from the README"
