"""bench/scale.py and bench/scale_sim.py at tiny sizes: they run, and what they report holds together."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def bench(name: str, *args: str, env: dict[str, str] | None = None) -> dict:
    out = args[args.index("--out") + 1]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", name), *args], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_the_simulation_balances_shards_and_counts_moves(tmp_path) -> None:
    r = bench("scale_sim.py", "--tenants", "2000", "--groups", "200", "--replicas", "4", "--shards", "16",
              "--rounds", "1", "--out", str(tmp_path / "sim.json"))
    assert r["cores"] == os.cpu_count()
    assert r["balance"]["shards_per_replica"]["max"] == 4  # ceil(16 / 4)
    assert 4 * r["balance"]["groups_per_replica"]["mean"] == 200
    loss = r["replica_loss"]
    assert loss["assignment"]["groups_moved"] >= loss["groups_moved_floor"] > 0
    assert loss["replicas_keeping_their_shards"]["groups_moved"] == loss["groups_moved_floor"]
    assert r["event_rate"]["cluster_events_per_s"] == 2000 * 2 / 10
    run = r["engine_run"]
    assert run["events"] == 2 * run["tenants"] and run["tenants"] == r["event_rate"]["busiest_replica_tenants"]


def test_two_replicas_share_the_load_without_double_grants(etcd, tmp_path, child_env) -> None:
    r = bench("scale.py", "--tenants", "40", "--groups", "8", "--workers", "1", "--seconds", "1", "--replicas", "2",
              "--shards", "4", "--etcd", etcd.url, "--out", str(tmp_path / "scale.json"), env=child_env)
    (run,) = r["runs"]
    assert r["cores"] == os.cpu_count() and run["replicas"] == 2
    assert run["burst"]["grants"] == 40 and run["steady"]["grants"] > 0 and run["free_group_under_load"]["grants"] > 0
    assert run["double_grants"] == 0 and run["release_errors"] == 0
    memory = run["memory"]  # the replicas' RSS at both ends, per tenant (the probe included)
    assert memory["tenants"] == 41 and all(rss > 0 for rss in memory["rss_before_bytes"] + memory["rss_after_bytes"])
    assert memory["bytes_per_tenant"] == round(memory["added_bytes"] / 41)
    assert len(r["load_average_at_start"]) == 3 and run["load_average_1m"]["after"] >= 0
