"""Failures a user understands: an unreachable or refusing orchestrator fails the first turn in bounded
time with the address and where it came from; every env var is checked where it is read."""

from __future__ import annotations

import logging
import time

import pytest

import rota
from rota import auth
from rota.errors import ConfigError, Unauthenticated, Unavailable
from rota.testing import free_port, running_orchestrator


def test_unreachable_orchestrator_fails_the_first_turn_within_the_connect_timeout(monkeypatch, caplog):
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("ROTA_ORCHESTRATOR", dead)
    monkeypatch.setenv("ROTA_CONNECT_TIMEOUT_S", "1.5")
    gpu = rota.connect(group="g", tenant="t")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rota._tenant"), pytest.raises(Unavailable) as err:
        gpu.acquire()
    assert 1.4 < time.monotonic() - t0 < 10
    assert dead in str(err.value) and "ROTA_ORCHESTRATOR" in str(err.value) and "ROTA_CONNECT_TIMEOUT_S" in \
        str(err.value)
    lost = [r for r in caplog.records if "session of t" in r.getMessage()]
    assert 1 <= len(lost) <= 2  # once, not five times a second
    gpu.close()


def test_an_orchestrator_that_refuses_the_tenant_says_why_at_once():
    key = b"q" * 32
    with running_orchestrator(auth=auth.ServerAuth(key=key)) as (endpoint, _):
        gpu = rota.Gpu("g", "t", endpoint, connect_timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(Unauthenticated) as err:
            gpu.acquire()
        assert time.monotonic() - t0 < 10 and "refused job 't'" in str(err.value) and "ROTA_TOKEN" in str(err.value)
        gpu.close()


@pytest.mark.parametrize("env,needle", [
    ({"ROTA_RANK": "3"}, "ROTA_WORLD_SIZE is not"),
    ({"ROTA_RESIDUE_MAX_BYTES": "lots"}, "ROTA_RESIDUE_MAX_BYTES='lots' is not a size"),
    ({"ROTA_CONNECT_TIMEOUT_S": "soon"}, "ROTA_CONNECT_TIMEOUT_S='soon' is not a number"),
])
def test_bad_environment_is_refused_at_connect(monkeypatch, env, needle):
    monkeypatch.setenv("ROTA_ORCHESTRATOR", "127.0.0.1:1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as err:
        rota.connect(group="g", tenant="t")
    assert needle in str(err.value)


def test_sizes_take_units_everywhere(monkeypatch):
    from rota.residue import residue_max_bytes

    monkeypatch.setenv("ROTA_RESIDUE_MAX_BYTES", "512MiB")
    assert residue_max_bytes() == 512 << 20


def test_status_json_follows_its_schema_with_numbers_as_numbers(tmp_path):
    """`rota status --json` against a real orchestrator, validated with the documented JSON Schema."""
    import json
    import pathlib
    import subprocess
    import sys

    import jsonschema

    import rota.cli

    with running_orchestrator() as (endpoint, _):
        gpu = rota.connect(group="g", tenant="t", endpoint=endpoint)
        with gpu.turn():
            out = subprocess.run([sys.executable, "-m", "rota", "status", "--json", "--orchestrator", endpoint],
                                 capture_output=True, text=True, timeout=60)
        gpu.close()
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    schema = json.loads((pathlib.Path(rota.cli.__file__).parent / "status.schema.json").read_text())
    jsonschema.validate(doc, schema)
    group = doc["groups"][0]
    assert group["state"] == "held" and group["token"] == 1 and group["switches"] == 0  # numbers, zeros present
    assert group["tenants"][0]["state"] == "holding" and group["tenants"][0]["fault"] == ""


def test_metrics_endpoint_is_scraped_and_parsed(tmp_path):
    """A real `rota orchestrator serve --metrics-listen`, a real tenant's turns, a real HTTP scrape, parsed with
    prometheus_client's own parser."""
    import os
    import subprocess
    import sys
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port, mport = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    server = subprocess.Popen([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen",
                               f"127.0.0.1:{port}", "--insecure", "--metrics-listen", f"127.0.0.1:{mport}"],
                              env=env, stderr=subprocess.DEVNULL)
    try:
        gpu = rota.Gpu("g", "trainer", f"127.0.0.1:{port}", connect_timeout_s=20)
        for _ in range(3):
            with gpu.turn():
                pass
        with gpu.turn():
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        gpu.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    grants = {s.labels["group"]: s.value for s in families["rota_grants"].samples if s.name == "rota_grants_total"}
    assert grants == {"g": 4}
    waits = [s for s in families["rota_turn_wait_seconds"].samples if s.name.endswith("_count")]
    assert waits[0].value == 4
    holder = [s for s in families["rota_group_holder"].samples]
    assert [(s.labels["job"], s.value) for s in holder] == [("trainer", 1)]
    states = {s.labels["state"]: s.value for s in families["rota_tenant_state"].samples}
    assert states["holding"] == 1 and sum(states.values()) == 1
    assert families["rota_orchestrator_leader"].samples[0].value == 1  # a single orchestrator always grants


def test_ended_tenants_leave_the_status_after_their_grace_and_are_counted():
    """A tenant that closed its session is forgotten once ended_tenant_ttl_s passes (the group it used stays,
    with its other tenant), and rota_tenants_collected counts it."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from rota._orchestrator.metrics import OrchestratorMetrics
    from rota.orchestrator import OrchestratorConfig
    from rota.testing import running_orchestrator

    config = OrchestratorConfig(ended_tenant_ttl_s=0.5, idle_group_ttl_s=0)
    with running_orchestrator(config) as (ep, eng):
        eng.report_metrics_to(OrchestratorMetrics(lambda: eng.groups))
        stays, leaves = (rota.connect(group="g", tenant=t, endpoint=ep) for t in ("stays", "leaves"))
        for gpu in (stays, leaves):
            with gpu.turn():
                pass
        leaves.close()
        deadline = time.monotonic() + 15
        while "leaves" in eng.groups["g"].tenants and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(eng.groups["g"].tenants) == {"stays"}
        text = generate_latest(eng.metrics.registry).decode()
        stays.close()
    counted = {s.labels["group"]: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "rota_tenants_collected_total"}
    assert counted == {"g": 1.0}
