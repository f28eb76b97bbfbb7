"""rota.admin over real gRPC on loopback against the embedded engine: evict and status, as rota status,
rota_slurm's epilog and rota_k8s's controller call them."""

from __future__ import annotations

import threading

import pytest

from rota import auth
from rota.admin import EvictResult, evict, fetch_status
from rota.errors import NotFound, PermanentError, TransientError, Unauthenticated, Unavailable
from rota.orchestrator import OrchestratorConfig
from rota.testing import eventually, free_port, running_orchestrator, tenants

KEY = b"a" * 32


def test_evict_drops_a_waiter_ends_a_turn_and_is_idempotent(orchestrator):
    endpoint, _ = orchestrator
    with tenants(endpoint) as connect:
        holder, waiter = connect("holder"), connect("waiter")
        holder.acquire()
        waiting = threading.Thread(target=waiter.acquire, daemon=True)
        waiting.start()
        eventually(lambda: list(fetch_status(endpoint, "g").groups[0].queue) == ["waiter"], "the waiter to queue")
        assert evict(endpoint, "waiter", "g", reason="test") == EvictResult(was_holder=False, was_queued=True)
        # the waiter's client acquires again (its place was lost, as asked); the holder's eviction hands it the turn
        eventually(lambda: list(fetch_status(endpoint, "g").groups[0].queue) == ["waiter"], "the waiter to queue again")
        assert evict(endpoint, "holder", "g", reason="test") == EvictResult(was_holder=True, was_queued=False)
        waiting.join(30)
        assert fetch_status(endpoint, "g").groups[0].holder == "waiter"
        assert evict(endpoint, "holder", "g", reason="again") == EvictResult(False, False)
        holder.grant = None  # its turn was ended for it


def test_a_group_the_orchestrator_does_not_have_is_already_gone_for_evict_and_not_found_for_status():
    with running_orchestrator(OrchestratorConfig(groups=("g",))) as (endpoint, _):
        assert evict(endpoint, "j", "other", reason="test") == EvictResult(False, False, gone=True)
        assert evict(endpoint, "j", "g", reason="test") == EvictResult(False, False, gone=False)
        with pytest.raises(NotFound, match="'other' does not exist"):
            fetch_status(endpoint, "other")
        assert [g.group_id for g in fetch_status(endpoint).groups] == ["g"]


def test_evict_carries_the_token_and_is_refused_without_the_right_one():
    with running_orchestrator(auth=auth.ServerAuth(key=KEY)) as (endpoint, _):
        assert evict(endpoint, "j", "g", reason="test", token=auth.issue(KEY, admin=True)) == EvictResult(False, False)
        with pytest.raises(PermanentError, match="may not evict job 'j'"):  # refused at once, never retried
            evict(endpoint, "j", "g", reason="test", token=auth.issue(KEY, group="g", job="other"))
        with pytest.raises(Unauthenticated):
            evict(endpoint, "j", "g", reason="test", token="")
        assert [g.group_id for g in fetch_status(endpoint, token=auth.issue(KEY, admin=True)).groups] == ["g"]


def test_evict_of_an_unreachable_orchestrator_fails_at_once_without_retries_and_at_the_timeout_with_them():
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable):  # one attempt, not waiting for the server: the caller retries later
        evict(dead, "j", "g", reason="test", retry=False)
    with pytest.raises(TransientError):  # waited for the server until the timeout
        evict(dead, "j", "g", reason="test", timeout=0.5)


def test_status_reads_every_page():
    config = OrchestratorConfig(groups=tuple(f"g{i:03d}" for i in range(501)))  # 500 groups per page
    with running_orchestrator(config) as (endpoint, _):
        reply = fetch_status(endpoint)
    assert [g.group_id for g in reply.groups] == sorted(config.groups)
