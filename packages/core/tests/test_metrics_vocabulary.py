"""One metrics vocabulary: ``/metrics`` and ``rota status --prometheus`` print the same group families with the
same names, labels and values; restores are a histogram like parks (those the orchestrator drives, and a tenant's
own at its grant, reported with its release); the README lists every family ``/metrics`` serves.

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

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rota._orchestrator.metrics import OrchestratorMetrics
from rota.orchestrator import OrchestratorConfig
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
            assert c.ask("acquire")["restored"] is True  # parks a and b; c restores itself at its grant
            c.ask("release")  # ... and reports how long that took
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
    assert states == {"a": "parked", "b": "parked", "c": "ended"}
    restores = served["rota_restore_seconds"]  # b's prefetch (driven here) and c's own at its grant (reported)
    assert restores[("rota_restore_seconds_count", (("group", "g"),))] == 2
    assert restores[("rota_restore_seconds_sum", (("group", "g"),))] > 0
    assert served["rota_restores"][("rota_restores_total", (("group", "g"), ("outcome", "ok")))] == 1
    assert served["rota_park_seconds"][("rota_park_seconds_count", (("group", "g"),))] == 4  # b, c, then a and b

    documented = set(re.findall(r"`(rota_[a-z0-9_]+)", README.read_text()))
    for name in (n for n in served if not n.endswith("_created")):  # counters are named with their _total
        assert name in documented or f"{name}_total" in documented, f"{name} missing from the README"


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), 1e9])
def test_a_release_with_a_bad_restore_time_is_refused_naming_it(bad):
    """restore_seconds feeds a histogram: a caller cannot push NaN, negatives or absurd values into it."""
    import grpc

    from rota.wire import rota_v1_pb2 as pb
    from rota.wire import rota_v1_pb2_grpc as pb_grpc

    with running_orchestrator() as (ep, engine):
        metrics = OrchestratorMetrics(lambda: engine.groups)
        engine.report_metrics_to(metrics)
        with grpc.insecure_channel(ep) as ch:
            stub = pb_grpc.RotaServiceStub(ch)
            grant = stub.Acquire(pb.TurnRequest(job_id="j", group_id="g"), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                stub.Release(pb.ReleaseRequest(job_id="j", group_id="g", token=grant.token, restore_seconds=bad),
                             timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "restore_seconds" in err.value.details()
            stub.Release(pb.ReleaseRequest(job_id="j", group_id="g", token=grant.token, restore_seconds=0.25),
                         timeout=30)
        observed = metrics.registry.get_sample_value("rota_restore_seconds_count", {"group": "g"})
        assert observed == 1 and metrics.registry.get_sample_value("rota_restore_seconds_sum", {"group": "g"}) == 0.25


def test_a_jobs_restore_at_its_grant_is_its_slowest_rank_observed_once():
    import concurrent.futures

    import grpc

    from rota.wire import rota_v1_pb2 as pb
    from rota.wire import rota_v1_pb2_grpc as pb_grpc

    with running_orchestrator() as (ep, engine):
        metrics = OrchestratorMetrics(lambda: engine.groups)
        engine.report_metrics_to(metrics)
        with grpc.insecure_channel(ep) as ch, concurrent.futures.ThreadPoolExecutor(2) as pool:
            stub = pb_grpc.RotaServiceStub(ch)
            asks = [pool.submit(stub.Acquire, pb.TurnRequest(job_id="ddp", group_id="g", world_size=2, rank=r),
                                timeout=30) for r in (0, 1)]
            token = {a.result().token for a in asks}.pop()  # one grant, once both ranks asked
            for rank, seconds in ((0, 0.1), (1, 0.3)):
                stub.Release(pb.ReleaseRequest(job_id="ddp", group_id="g", token=token, rank=rank,
                                               restore_seconds=seconds), timeout=30)
                count = metrics.registry.get_sample_value("rota_restore_seconds_count", {"group": "g"})
                assert count == (None if rank == 0 else 1)  # observed when the job's turn ends, not per rank
        assert metrics.registry.get_sample_value("rota_restore_seconds_sum", {"group": "g"}) == 0.3
