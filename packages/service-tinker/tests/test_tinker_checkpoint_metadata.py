"""Checkpoint and session metadata round-trips through the real tinker SDK on a tiny Qwen3 folder: TTLs are enforced
and reported (``expires_at``), user metadata and display names read back as written, publish/unpublish mark the
owner's checkpoints, ``get_weights_info_by_tinker_path`` and the storage usage describe them, a training checkpoint
can be sampled from, and a name already taken is refused at once (not retried)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.lib.public_interfaces.admin_client import AdminClient
from tinker_testlib import KEYS, serving_tiny_qwen

from rota_tinker import TinkerService
from rota_tinker._http.checkpoints import MIN_TTL_S

QWEN = "acme/Qwen3-Tiny"
TIMEOUT = 180
PROMPT = types.ModelInput.from_ints([17, 42, 99, 5, 230, 61, 7])


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with serving_tiny_qwen(tmp_path_factory.mktemp("meta"), "tinker-meta", seed=5) as s:
        yield s


@pytest.fixture(scope="module")
def clients(svc: TinkerService) -> Iterator[tuple[tinker.ServiceClient, tinker.RestClient, tinker.TrainingClient]]:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"], user_metadata={"team": "rl", "exp": "7"},
                              display_name="math run 7")
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["alice"])
    tc = sc.create_lora_training_client(base_model=QWEN, rank=3, seed=2, train_unembed=False,
                                        user_metadata={"stage": "warmup"}).result(timeout=TIMEOUT)
    ids = list(range(3, 20))
    tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                     loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})],
                        "cross_entropy").result(timeout=TIMEOUT)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT)
    yield sc, rest, tc


def listed(rest: tinker.RestClient, run: str) -> dict[str, types.Checkpoint]:
    return {c.checkpoint_id: c for c in rest.list_checkpoints(run).result(timeout=TIMEOUT).checkpoints}


def close_to(when: datetime.datetime | None, seconds: float) -> bool:
    return when is not None and abs(when.timestamp() - (time.time() + seconds)) < 60


def test_session_and_run_metadata_read_back(clients: tuple) -> None:
    sc, rest, tc = clients
    session = rest.get_session(sc.holder.get_session_id()).result(timeout=TIMEOUT)
    assert session.user_metadata == {"team": "rl", "exp": "7"} and session.display_name == "math run 7"
    assert tc.model_id in session.training_run_ids
    assert rest.get_training_run(tc.model_id).result(timeout=TIMEOUT).user_metadata == {"stage": "warmup"}


def test_ttl_is_reported_enforced_and_changed(svc: TinkerService, clients: tuple) -> None:
    _, rest, tc = clients
    kept = tc.save_state("kept", ttl_seconds=3600, user_metadata={"step": "1"}).result(timeout=TIMEOUT).path
    forever = tc.save_weights_for_sampler("forever", user_metadata={"use": "eval"}).result(timeout=TIMEOUT).path
    brief = tc.save_state("brief", ttl_seconds=MIN_TTL_S).result(timeout=TIMEOUT).path
    cks = listed(rest, tc.model_id)
    assert cks["weights/kept"].user_metadata == {"step": "1"} and close_to(cks["weights/kept"].expires_at, 3600)
    assert cks["sampler_weights/forever"].user_metadata == {"use": "eval"}
    assert cks["sampler_weights/forever"].expires_at is None
    folder = Path(svc.state.runs.checkpoints[brief].folder)
    assert folder.is_dir()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):  # under the minimum: refused, not retried
        tc.save_state("too-brief", ttl_seconds=MIN_TTL_S - 1).result(timeout=30)
    rest.set_checkpoint_ttl_from_tinker_path(forever, 7200).result(timeout=TIMEOUT)
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result(timeout=TIMEOUT)
    cks = listed(rest, tc.model_id)
    assert close_to(cks["sampler_weights/forever"].expires_at, 7200) and cks["weights/kept"].expires_at is None
    deadline = time.time() + MIN_TTL_S + 60  # a hang guard: the TTL passes after MIN_TTL_S
    while "weights/brief" in listed(rest, tc.model_id) and time.time() < deadline:
        time.sleep(0.5)
    assert "weights/brief" not in listed(rest, tc.model_id)
    with pytest.raises(tinker.NotFoundError, match=r"expired|does not exist"):
        tc.load_state(brief).result(timeout=30)
    while folder.exists() and time.time() < deadline:  # the files go at the next sweep (any request, once a second)
        rest.list_checkpoints(tc.model_id).result(timeout=TIMEOUT)
        time.sleep(0.5)
    assert not folder.exists()
    assert "weights/kept" in listed(rest, tc.model_id)


def test_publish_unpublish_weights_info_and_storage(clients: tuple) -> None:
    _, rest, tc = clients
    path = tc.save_state("shown").result(timeout=TIMEOUT).path
    sampler = tc.save_weights_for_sampler("shown").result(timeout=TIMEOUT).path
    rest.publish_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT)
    rest.publish_checkpoint_from_tinker_path(sampler).result(timeout=TIMEOUT)
    cks = listed(rest, tc.model_id)
    assert cks["weights/shown"].public and cks["sampler_weights/shown"].public
    rest.unpublish_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT)
    cks = listed(rest, tc.model_id)
    assert not cks["weights/shown"].public and cks["sampler_weights/shown"].public
    for p in (path, sampler):
        info = rest.get_weights_info_by_tinker_path(p).result(timeout=TIMEOUT)
        assert (info.base_model, info.is_lora, info.lora_rank) == (QWEN, True, 3)
        assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, False)
    usage = AdminClient(rest.holder).get_current_checkpoint_storage_usage().result(timeout=TIMEOUT).data
    mine = rest.list_user_checkpoints(limit=1000).result(timeout=TIMEOUT).checkpoints
    assert [(u.checkpoint_count, u.size_bytes) for u in usage] == [(len(mine), sum(c.size_bytes for c in mine))]


def test_sampling_from_a_training_checkpoint_equals_its_sampler_weights(clients: tuple) -> None:
    sc, _, tc = clients
    state = tc.save_state("to-sample").result(timeout=TIMEOUT).path
    weights = tc.save_weights_for_sampler("to-sample").result(timeout=TIMEOUT).path
    from_state = sc.create_sampling_client(model_path=state).result(timeout=TIMEOUT)
    from_weights = sc.create_sampling_client(model_path=weights).result(timeout=TIMEOUT)
    base = sc.create_sampling_client(base_model=QWEN).result(timeout=TIMEOUT)
    a = from_state.compute_logprobs(PROMPT).result(timeout=TIMEOUT)
    b = from_weights.compute_logprobs(PROMPT).result(timeout=TIMEOUT)
    assert a == b and a != base.compute_logprobs(PROMPT).result(timeout=TIMEOUT)  # trained weights, the same ones
    params = types.SamplingParams(max_tokens=6, seed=9)
    assert (list(from_state.sample(PROMPT, 1, params).result(timeout=TIMEOUT).sequences[0].tokens)
            == list(from_weights.sample(PROMPT, 1, params).result(timeout=TIMEOUT).sequences[0].tokens))
    rest = clients[1]
    rest.delete_checkpoint_from_tinker_path(state).result(timeout=TIMEOUT)
    with pytest.raises(tinker.NotFoundError):  # its sampling sessions end with it: no sampling deleted weights
        from_state.compute_logprobs(PROMPT).result(timeout=TIMEOUT)
    assert from_weights.compute_logprobs(PROMPT).result(timeout=TIMEOUT) == b


def test_a_taken_name_is_refused_at_once(clients: tuple) -> None:
    _, _, tc = clients
    tc.save_state("once").result(timeout=TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="exists"):  # a 409 would be retried for 5 minutes
        tc.save_state("once").result(timeout=30)
    tc.save_weights_for_sampler("once").result(timeout=TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="exists"):
        tc.save_weights_for_sampler("once").result(timeout=30)


def test_audit_log_records_what_a_tenant_did_to_its_checkpoints(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["carol"])
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["carol"])
    tc = sc.create_lora_training_client(base_model=QWEN, rank=2, seed=1).result(timeout=TIMEOUT)
    path = tc.save_state("audited").result(timeout=TIMEOUT).path
    rest.publish_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT)
    rest.set_checkpoint_ttl_from_tinker_path(path, 600).result(timeout=TIMEOUT)
    tc.load_state(path).result(timeout=TIMEOUT)
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT)
    rest.assign_session_project(sc.holder.get_session_id(), "audit-proj").result(timeout=TIMEOUT)
    admin = AdminClient(rest.holder)
    entries = admin.get_audit_log().result(timeout=TIMEOUT).entries
    assert [(e.event, e.event_details.get("tinker_path"), e.event_details.get("purpose")) for e in entries] == [
        ("checkpoint_create", path, None), ("checkpoint_publish", path, None), ("checkpoint_ttl_set", path, None),
        ("checkpoint_read", path, "load"), ("checkpoint_delete", path, None), ("project_session_assign", None, None)]
    assert all(e.event_details["actor"] == "carol" for e in entries)
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    assert [e.event for e in rest.get_audit_log("projects").result(timeout=TIMEOUT).entries] == [
        "project_session_assign"]
    yesterday = datetime.datetime.now(datetime.timezone.utc).date() - datetime.timedelta(days=1)
    assert admin.get_audit_log(day=yesterday).result(timeout=TIMEOUT).entries == []
    assert admin.get_audit_log("teams").result(timeout=TIMEOUT).entries == []
    other = AdminClient(tinker.RestClient(base_url=svc.url, api_key=KEYS["dave"]).holder)
    assert all(e.event_details["actor"] == "dave" for e in other.get_audit_log().result(timeout=TIMEOUT).entries)


def test_billing_usage_counts_tokens_and_checkpoints_by_the_hour(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["bob"], user_metadata={"who": "bob"})
    tc = sc.create_lora_training_client(base_model=QWEN, rank=2, seed=1).result(timeout=TIMEOUT)
    ids = list(range(3, 12))
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})
    tc.forward_backward([datum, datum], "cross_entropy").result(timeout=TIMEOUT)
    tc.forward([datum], "cross_entropy").result(timeout=TIMEOUT)
    path = tc.save_weights_for_sampler("billed").result(timeout=TIMEOUT).path
    tc.save_state("billed").result(timeout=TIMEOUT)
    sampler = sc.create_sampling_client(model_path=path).result(timeout=TIMEOUT)
    res = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=5, seed=2)).result(timeout=TIMEOUT)
    hour = datetime.datetime.now(datetime.timezone.utc).replace(minute=0, second=0, microsecond=0)
    admin = AdminClient(tinker.RestClient(base_url=svc.url, api_key=KEYS["bob"]).holder)
    usage = admin.get_billing_usage(hour - datetime.timedelta(hours=1),
                                    hour + datetime.timedelta(hours=2)).result(timeout=TIMEOUT)
    totals: dict[str, int] = {}
    for row in usage.data:  # one hour's buckets, or two if the test crossed an hour
        info = row.event_info
        totals[info.type] = totals.get(info.type, 0) + (info.count if info.type == "checkpoint" else info.token_count)
        assert row.session_id == sc.holder.get_session_id() and row.base_model == QWEN
        assert row.estimated_cost_usd is None  # no rate card here
    assert totals == {"training": 3 * 8, "checkpoint": 2, "sampling_prefill": PROMPT.length,
                      "sampling_sample": sum(len(s.tokens) for s in res.sequences)}
    assert usage.sessions[sc.holder.get_session_id()].user_metadata == {"who": "bob"}
    other = AdminClient(tinker.RestClient(base_url=svc.url, api_key=KEYS["dave"]).holder)
    assert all(row.session_id != sc.holder.get_session_id() for row in other.get_billing_usage(
        hour - datetime.timedelta(hours=1), hour + datetime.timedelta(hours=2)).result(timeout=TIMEOUT).data)
    with pytest.raises(tinker.BadRequestError, match="14 days"):
        admin.get_billing_usage(hour - datetime.timedelta(days=15), hour).result(timeout=30)
