"""Partitioned leadership (ROTA_ETCD_SHARDS): replicas lead disjoint shards of the groups, redirect the
rest, take over a dead replica's shards, and refuse a shard count other than the one etcd records."""

from __future__ import annotations

import collections

import pytest

import rota
from rota.testing import eventually
from rota_etcd._shards import assign, shard_of
from rota_etcd.testing import OrchestratorProcess, shard_leaders

SHARDS = 4


def test_assignment_is_balanced_and_moves_little_when_a_replica_leaves() -> None:
    replicas = [f"r{i}" for i in range(5)]
    before = assign(100, replicas)
    assert sorted(collections.Counter(before.values()).values()) == [20] * 5
    after = assign(100, replicas[1:])
    assert sorted(collections.Counter(after.values()).values()) == [25] * 4
    moved = [s for s in before if before[s] != after[s]]
    assert {s for s in before if before[s] == "r0"} <= set(moved) and len(moved) < 30  # r0's 20, plus a few
    assert assign(3, []) == {} and assign(3, ["only"]) == {0: "only", 1: "only", 2: "only"}
    assert shard_of("group-7", 1) == 0 and shard_of("group-7", 16) == shard_of("group-7", 16) < 16


def test_two_replicas_share_the_shards_redirect_and_take_over(etcd, tmp_path, child_env, prefix) -> None:
    env = dict(child_env, ROTA_ETCD_SHARDS=str(SHARDS))
    orchs = [OrchestratorProcess(etcd.url, tmp_path / f"orch{i}.log", args=["--ttl", "3"], env=env).start()
             for i in range(2)]
    try:
        both = {o.endpoint for o in orchs}
        leaders = eventually(lambda: (lambda m: m if len(m) == SHARDS and set(m.values()) == both else None)(
            shard_leaders(etcd.url, prefix)), "each replica leading some of the shards", timeout=20)
        # one group per shard: every tenant asks the first replica and is sent on to its group's leader
        groups = {}
        for i in range(64):
            groups.setdefault(shard_of(f"g{i}", SHARDS), f"g{i}")
        assert len(groups) == SHARDS
        for group in groups.values():
            gpu = rota.connect(group=group, tenant=f"t-{group}", endpoint=",".join(o.endpoint for o in orchs))
            try:
                assert gpu.acquire().token == 1
                gpu.release()
            finally:
                gpu.close()
        # the second replica dies: the first takes over its shards and their groups grant again
        dead = orchs[1]
        dead.kill()
        eventually(lambda: set(shard_leaders(etcd.url, prefix).values()) == {orchs[0].endpoint}
                   and len(shard_leaders(etcd.url, prefix)) == SHARDS, "the survivor leading every shard", timeout=20)
        for group in groups.values():
            gpu = rota.connect(group=group, tenant=f"t-{group}", endpoint=orchs[0].endpoint)
            try:
                assert gpu.acquire().token == 2
                gpu.release()
            finally:
                gpu.close()
        assert any(leaders[s] == dead.endpoint for s in groups)
        # the first replica led every shard alone, then handed the second its share when it joined
        assert "handed over to replica" in orchs[0].log_tail(20000)
    finally:
        for o in orchs:
            o.stop()


def test_a_replica_with_another_shard_count_refuses_to_start(etcd, tmp_path, child_env, prefix) -> None:
    with OrchestratorProcess(etcd.url, tmp_path / "a.log", env=dict(child_env, ROTA_ETCD_SHARDS="4")):
        other = OrchestratorProcess(etcd.url, tmp_path / "b.log", env=dict(child_env, ROTA_ETCD_SHARDS="8"))
        with pytest.raises(RuntimeError, match="ROTA_ETCD_SHARDS=8 but the replicas"):
            other.start()
        assert "set ROTA_ETCD_SHARDS=4 on every replica" in other.log_tail()
